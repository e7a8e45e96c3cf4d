"""Small RL helpers for training-service clients: GRPO group advantages, and the built-in
``ppo`` loss written in Python for :meth:`TrainingClient.forward_backward_custom`.

The formulas are the trainer's (trainer/losses.h): per token, with r = exp(logp -
logp_sampler) and A the advantage,

    ppo   l = max(-r A, -clip(r, 1 - clip_low, 1 + clip_high) A)
          (dual_clip c > 1: tokens with A < 0 are capped at -c A)
    TIS   l *= min(exp(logp - logp_sampler), tis_cap)   (a constant factor; tis_cap 0: off)

aggregated over the batch with the datums' weights w:

    token-mean                sum(w l) / sum(w)
    seq-mean-token-mean       mean over sequences with sum(w) > 0 of sum_t(w l) / sum_t(w)
    seq-mean-token-sum-norm   mean over sequences of sum_t(w l) / L  (L = norm_length, or
                              the longest datum's T when 0)
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

try:
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def group_advantages(rewards: Sequence[float], normalize_std: bool = True, eps: float = 1e-6,
                     group_size: Optional[int] = None) -> List[float]:
    """GRPO advantages: each reward minus its group's mean, divided by (the group's std +
    ``eps``) when ``normalize_std`` (the unbiased std, n - 1, as torch.std and the trainer's
    ComputeGroupAdvantages; ``normalize_std=False`` is Dr. GRPO).

    ``rewards`` is one group, or consecutive groups of ``group_size``. Raises ValueError for
    rewards that do not split into groups, a non-finite reward, or std normalisation of
    groups of one.
    """
    values = [float(r) for r in rewards]
    size = len(values) if group_size is None else int(group_size)
    if size <= 0 or (values and len(values) % size):
        raise ValueError(f"{len(values)} rewards do not split into groups of {size}")
    if normalize_std and size < 2 and values:
        raise ValueError("std normalisation needs groups of at least 2 rewards")
    for index, value in enumerate(values):
        if not math.isfinite(value):
            raise ValueError(f"reward {index} is not finite: {value}")
    out: List[float] = []
    for start in range(0, len(values), size):
        group = values[start:start + size]
        mean = sum(group) / size
        centred = [r - mean for r in group]
        if normalize_std:
            std = math.sqrt(sum(c * c for c in centred) / (size - 1))
            centred = [c / (std + eps) for c in centred]
        out.extend(centred)
    return out


def aggregate(per_token: Sequence[Any], d_per_token: Sequence[Any], weights: Sequence[Any],
              aggregation: str = "token-mean", norm_length: float = 0.0
              ) -> Tuple[float, List[Any]]:
    """The aggregated loss of per-token losses and its gradient: ``per_token[i]`` and
    ``d_per_token[i]`` (d l / d logprob, same length) and ``weights[i]`` for datum i (numpy
    arrays). Returns (loss, [d loss / d logprob per datum]) as the trainer aggregates."""
    _require_numpy()
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r} (known: {', '.join(AGGREGATIONS)})")
    w = [_np.asarray(x, dtype=_np.float64) for x in weights]
    if aggregation == "token-mean":
        total = max(sum(float(x.sum()) for x in w), 1e-12)
        loss = sum(float((l * x).sum()) for l, x in zip(per_token, w)) / total
        return loss, [x * d / total for x, d in zip(w, d_per_token)]
    if aggregation == "seq-mean-token-mean":
        sums = [float(x.sum()) for x in w]
        sequences = max(sum(1 for s in sums if s > 0), 1)
        loss = sum(float((l * x).sum()) / max(s, 1e-12)
                   for l, x, s in zip(per_token, w, sums) if s > 0) / sequences
        grads = [x * d / (max(s, 1e-12) * sequences) if s > 0 else _np.zeros_like(x)
                 for x, d, s in zip(w, d_per_token, sums)]
        return loss, grads
    length = norm_length if norm_length > 0 else max(len(x) for x in w)
    count = len(w)
    loss = sum(float((l * x).sum()) for l, x in zip(per_token, w)) / (count * length)
    return loss, [x * d / (count * length) for x, d in zip(w, d_per_token)]


def ppo_loss_fn(clip_low: float = 0.2, clip_high: float = 0.2, tis_cap: float = 0.0,
                aggregation: str = "token-mean", norm_length: float = 0.0,
                dual_clip: float = 0.0) -> Callable[[List[Any], List[Any]], Tuple[float, List[Any]]]:
    """The built-in ``ppo`` loss (with ``tis_cap``) as a forward_backward_custom loss_fn:
    ``forward_backward_custom(datums, ppo_loss_fn(...))`` accumulates the gradient that
    ``forward_backward(datums, "ppo", ...)`` does, up to float rounding. The datums need
    ``logprobs`` (sampling) and ``advantages``. Needs numpy."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r} (known: {', '.join(AGGREGATIONS)})")
    low, high = 1.0 - clip_low, 1.0 + clip_high

    def loss_fn(datums: List[Any], logprobs: List[Any]) -> Tuple[float, List[Any]]:
        _require_numpy()
        losses, grads, weights = [], [], []
        for index, (datum, current) in enumerate(zip(datums, logprobs)):
            lp = _np.asarray(current, dtype=_np.float64)
            if datum.logprobs is None or datum.advantages is None:
                raise ValueError(f"datum {index}: ppo needs sampling logprobs and advantages")
            sampled = _np.asarray(datum.logprobs, dtype=_np.float64)
            advantage = _np.asarray(datum.advantages, dtype=_np.float64)
            ratio = _np.exp(lp - sampled)
            unclipped = -ratio * advantage
            clipped = -_np.clip(ratio, low, high) * advantage
            loss = _np.maximum(unclipped, clipped)
            inside = (ratio >= low) & (ratio <= high)  # clamp passes the gradient here
            # torch's maximum splits the gradient of a tie between both sides.
            grad = _np.where(unclipped > clipped, -ratio * advantage,
                             _np.where(unclipped < clipped, _np.where(inside, -ratio * advantage, 0.0),
                                       -ratio * advantage * (0.5 + 0.5 * inside)))
            if dual_clip > 0:
                cap = -advantage * dual_clip
                capped_loss = _np.minimum(loss, cap)
                capped_grad = _np.where(loss < cap, grad, _np.where(loss > cap, 0.0, 0.5 * grad))
                negative = advantage < 0
                loss = _np.where(negative, capped_loss, loss)
                grad = _np.where(negative, capped_grad, grad)
            if tis_cap > 0:
                factor = _np.minimum(_np.exp(lp - sampled), tis_cap)  # no gradient through it
                loss, grad = loss * factor, grad * factor
            weight = (_np.ones_like(lp) if datum.weights is None
                      else _np.asarray(datum.weights, dtype=_np.float64))
            losses.append(loss)
            grads.append(grad)
            weights.append(weight)
        return aggregate(losses, grads, weights, aggregation, norm_length)

    return loss_fn


def _require_numpy() -> None:
    if _np is None:
        raise ImportError("flywheel.rl's losses need numpy")
