"""flywheel.rl: GRPO group advantages and the ppo loss written for forward_backward_custom,
checked against torch autograd of the trainer's formulas (trainer/losses.cc) and against
finite differences; and flywheel.torch_loss_fn.

Run: /usr/bin/python3 -m pytest tests/python/test_rl.py -q
"""

import math

import pytest

import flywheel
from flywheel import rl
from flywheel.training import Datum

np = pytest.importorskip("numpy")


# ---------------------------------------------------------------------------------------
# Group advantages


def test_group_advantages_of_one_group():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    expected = (np.array(rewards) - np.mean(rewards)) / (np.std(rewards, ddof=1) + 1e-6)
    assert rl.group_advantages(rewards) == pytest.approx(expected.tolist(), rel=1e-12)


def test_group_advantages_of_consecutive_groups():
    rewards = [1, 0, 0, 0, 2, 2, 2, 2, 0, 3, 0, 3]
    out = rl.group_advantages(rewards, group_size=4)
    for start in range(0, 12, 4):
        group = np.array(rewards[start:start + 4], dtype=float)
        want = (group - group.mean()) / (group.std(ddof=1) + 1e-6)
        assert out[start:start + 4] == pytest.approx(want.tolist(), rel=1e-12, abs=1e-12)
    assert out[4:8] == [0.0] * 4  # equal rewards: no signal


def test_group_advantages_without_std_is_dr_grpo():
    assert rl.group_advantages([3, 1, 2], normalize_std=False) == [1.0, -1.0, 0.0]


def test_group_advantages_eps():
    out = rl.group_advantages([1, 0], eps=0.5)
    std = math.sqrt(0.5)
    assert out == pytest.approx([0.5 / (std + 0.5), -0.5 / (std + 0.5)])


@pytest.mark.parametrize("kwargs, message", [
    (dict(rewards=[1, 2, 3], group_size=2), "3 rewards do not split into groups of 2"),
    (dict(rewards=[1], group_size=1), "groups of at least 2"),
    (dict(rewards=[1, float("nan")]), "reward 1 is not finite"),
    (dict(rewards=[1, 2], group_size=0), "groups of 0")])
def test_group_advantages_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rl.group_advantages(**kwargs)


def test_group_advantages_of_nothing():
    assert rl.group_advantages([], group_size=4) == []


# ---------------------------------------------------------------------------------------
# ppo as a custom loss


def make_datums(seed=0, lengths=(5, 3, 7, 4)):
    """Datums with prompt positions (weight 0), sampling logprobs near the current ones, and
    per-sequence advantages of both signs."""
    rng = np.random.default_rng(seed)
    datums, current = [], []
    for index, length in enumerate(lengths):
        prompt = 1 + index % 2
        weights = np.array([0.0] * prompt + [1.0] * (length - prompt), dtype=np.float32)
        if index == 2:
            weights[-1] = 0.5  # fractional weights aggregate as weights, not as a mask
        sampled = -rng.uniform(0.1, 3.0, length).astype(np.float32)
        lp = (sampled + rng.normal(0, 0.4, length)).astype(np.float32)
        lp[prompt] = sampled[prompt]  # ratio exactly 1: the tie of max(unclipped, clipped)
        advantage = float(rng.normal()) if index != 1 else -1.3
        datums.append(Datum(tokens=list(range(length)), target_tokens=list(range(length)),
                            weights=weights, logprobs=sampled,
                            advantages=np.full(length, advantage, dtype=np.float32)))
        current.append(lp)
    return datums, current


def torch_reference(datums, current, clip_low, clip_high, tis_cap, aggregation, dual_clip=0.0,
                    norm_length=0.0):
    """The trainer's ppo (trainer/losses.cc ComputeLoss + Aggregate) in torch, padded to
    [B, T] as the trainer pads, in double precision; returns (loss, grads per datum)."""
    torch = pytest.importorskip("torch")
    lengths = [len(d) for d in datums]
    width = max(lengths)

    def padded(rows):
        out = torch.zeros(len(rows), width, dtype=torch.float64)
        for i, row in enumerate(rows):
            out[i, :len(row)] = torch.tensor(np.asarray(row, dtype=np.float64))
        return out

    lp = padded(current).requires_grad_(True)
    sampled = padded([d.logprobs for d in datums])
    adv = padded([d.advantages for d in datums])
    w = padded([d.weights for d in datums])
    ratio = (lp - sampled).exp()
    per_token = torch.max(-ratio * adv, -ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    if dual_clip > 0:
        capped = torch.min(per_token, -adv * dual_clip)
        per_token = torch.where(adv.lt(0), capped, per_token)
    if tis_cap > 0:
        per_token = per_token * (lp.detach() - sampled).exp().clamp_max(tis_cap)
    if aggregation == "token-mean":
        loss = (per_token * w).sum() / w.sum().clamp_min(1e-12)
    elif aggregation == "seq-mean-token-mean":
        seq_w = w.sum(1)
        has = seq_w.gt(0)
        loss = ((per_token * w).sum(1) / seq_w.clamp_min(1e-12) * has).sum() / has.sum().clamp_min(1)
    else:
        length = norm_length if norm_length > 0 else width
        loss = (per_token * w).sum(1).mean() / length
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), [grad[i, :n].numpy() for i, n in enumerate(lengths)]


@pytest.mark.parametrize("aggregation", rl.AGGREGATIONS)
@pytest.mark.parametrize("tis_cap", [0.0, 2.0, 1.05])
@pytest.mark.parametrize("dual_clip", [0.0, 1.5])
def test_ppo_loss_fn_matches_the_trainer_formula(aggregation, tis_cap, dual_clip):
    datums, current = make_datums()
    loss, grads = rl.ppo_loss_fn(0.2, 0.28, tis_cap, aggregation, dual_clip=dual_clip)(datums, current)
    want_loss, want_grads = torch_reference(datums, current, 0.2, 0.28, tis_cap, aggregation,
                                            dual_clip)
    assert loss == pytest.approx(want_loss, rel=1e-12, abs=1e-12)
    for grad, want in zip(grads, want_grads):
        assert np.allclose(grad, want, rtol=1e-12, atol=1e-14)


def test_ppo_loss_fn_norm_length():
    datums, current = make_datums(seed=3)
    loss, grads = rl.ppo_loss_fn(aggregation="seq-mean-token-sum-norm", norm_length=16.0)(
        datums, current)
    want_loss, want_grads = torch_reference(datums, current, 0.2, 0.2, 0.0,
                                            "seq-mean-token-sum-norm", norm_length=16.0)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    assert all(np.allclose(g, w, rtol=1e-12, atol=1e-14) for g, w in zip(grads, want_grads))


def test_ppo_loss_fn_gradient_matches_finite_differences():
    datums, current = make_datums(seed=1)
    # Away from ties and clip edges, so the loss is smooth around the point.
    current = [c + 0.013 for c in current]
    fn = rl.ppo_loss_fn(0.2, 0.2, 0.0, "seq-mean-token-mean")
    _, grads = fn(datums, current)
    step = 1e-6
    for i in range(len(current)):
        for t in range(len(current[i])):
            up = [c.astype(np.float64) for c in current]
            down = [c.astype(np.float64) for c in current]
            up[i][t] += step
            down[i][t] -= step
            numeric = (fn(datums, up)[0] - fn(datums, down)[0]) / (2 * step)
            assert grads[i][t] == pytest.approx(numeric, abs=1e-6)


def test_ppo_loss_fn_needs_logprobs_and_advantages():
    with pytest.raises(ValueError, match="datum 0: ppo needs"):
        rl.ppo_loss_fn()([Datum([1], [2])], [np.zeros(1)])


def test_ppo_loss_fn_refuses_an_unknown_aggregation():
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        rl.ppo_loss_fn(aggregation="mean")


def test_torch_loss_fn_gives_autograd_grads():
    torch = pytest.importorskip("torch")
    datums, current = make_datums(seed=2)

    def reinforce(datums, logprobs):
        total = sum((lp * torch.tensor(np.asarray(d.weights)) *
                     torch.tensor(np.asarray(d.advantages))).sum() for d, lp in zip(datums, logprobs))
        return -total / len(datums)

    loss, grads = flywheel.torch_loss_fn(reinforce, dtype=torch.float64)(datums, current)
    want = sum(float((np.asarray(c, dtype=np.float64) * d.weights * d.advantages).sum())
               for d, c in zip(datums, current))
    assert loss == pytest.approx(-want / len(datums))
    for grad, datum in zip(grads, datums):
        assert grad.dtype == np.float32
        assert np.allclose(grad, -datum.weights * datum.advantages / len(datums), atol=1e-7)


def test_torch_loss_fn_refuses_a_non_scalar():
    torch = pytest.importorskip("torch")
    fn = flywheel.torch_loss_fn(lambda datums, logprobs: torch.stack(logprobs))
    with pytest.raises(TypeError, match="scalar tensor"):
        fn([Datum([1, 2], [2, 3])], [np.zeros(2, dtype=np.float32)])
