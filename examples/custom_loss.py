#!/usr/bin/env python3
"""The sort task with the RL loss written in Python (forward_backward_custom).

Same setting as examples/rl_sort.py (SFT warm-up, groups sampled by the workers, group
advantages), but the policy-gradient loss is computed here, not by a built-in loss of the
trainer: `forward_backward_custom(datums, loss_fn)` sends a `forward` for the policy's
current logprobs, calls `loss_fn(datums, logprobs) -> (loss, grads)` in this process, and
the server backpropagates `sum_t logprob[t] * grads[t]`, which has the loss's gradient.

Two losses, both REINFORCE with a truncated importance weight against the sampler
(w = min(exp(logp - logp_sampler), cap), no gradient through w), per-sequence token means:

    numpy   grads written by hand: d loss / d logp[t] = -w[t] A / (n_tokens x n_sequences)
    torch   the same loss in torch; flywheel.torch_loss_fn derives the grads by autograd

    examples/custom_loss.py --launch --steps 40
    examples/custom_loss.py --service DIR --loss torch

Prints a line per step and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import sort_task
from sort_task import SortTask, flywheel

try:
    import numpy as np
except ImportError:
    raise SystemExit("custom_loss.py computes its loss with numpy (python3-numpy)")


def reinforce_numpy(cap: float):
    """REINFORCE with truncated importance sampling; grads by hand."""

    def loss_fn(datums, logprobs):
        losses, grads = [], []
        sequences = sum(1 for d in datums if float(np.sum(d.weights)) > 0)
        for datum, current in zip(datums, logprobs):
            weights = np.asarray(datum.weights, dtype=np.float64)
            tokens = weights.sum()
            if tokens <= 0:
                grads.append(np.zeros(len(current), dtype=np.float32))
                continue
            logp = np.asarray(current, dtype=np.float64)
            importance = np.minimum(np.exp(logp - np.asarray(datum.logprobs)), cap)
            advantage = np.asarray(datum.advantages, dtype=np.float64)
            per_token = -importance * advantage * logp
            losses.append(float((weights * per_token).sum() / tokens))
            grads.append((-weights * importance * advantage / (tokens * sequences))
                         .astype(np.float32))
        return sum(losses) / max(sequences, 1), grads

    return loss_fn


def reinforce_torch(cap: float):
    """The same loss in torch: autograd gives the grads (flywheel.torch_loss_fn)."""
    import torch

    def loss(datums, logprobs):
        per_sequence = []
        for datum, logp in zip(datums, logprobs):
            weights = torch.as_tensor(np.asarray(datum.weights), dtype=logp.dtype)
            if float(weights.sum()) <= 0:
                continue
            sampled = torch.as_tensor(np.asarray(datum.logprobs), dtype=logp.dtype)
            advantage = torch.as_tensor(np.asarray(datum.advantages), dtype=logp.dtype)
            importance = (logp.detach() - sampled).exp().clamp_max(cap)
            per_sequence.append((weights * -importance * advantage * logp).sum() / weights.sum())
        return torch.stack(per_sequence).mean()

    return flywheel.torch_loss_fn(loss)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sort_task.add_service_arguments(parser)
    parser.add_argument("--loss", choices=("numpy", "torch"), default="numpy")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--digits", type=int, default=6)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--tis-cap", type=float, default=2.0)
    parser.add_argument("--sft-steps", type=int, default=30)
    args = parser.parse_args(argv)
    loss_fn = reinforce_torch(args.tis_cap) if args.loss == "torch" else reinforce_numpy(args.tis_cap)

    task = SortTask(args.digits)
    rng = random.Random(args.seed)
    held_out = task.held_out(args.eval_prompts)
    with sort_task.Service.from_arguments(args) as service:
        service_client = flywheel.ServiceClient(service.trainer, service.token)
        sort_task.check_model(service_client.info())
        trainer = service_client.create_session()
        sampler = flywheel.SamplingClient(service.workers, service.token)
        started = time.monotonic()
        try:
            pool = [sort_task.sft_datum(*task.sample(rng)) for _ in range(4000)]
            warm_up = []
            for _ in range(args.sft_steps):  # built-in cross-entropy, calls pipelined
                warm_up.append(trainer.forward_backward_async(
                    [rng.choice(pool) for _ in range(32)], loss="cross_entropy"))
                warm_up.append(trainer.optim_step_async(lr=1e-3))
            for future in warm_up:
                future.result()
            weights = trainer.save_weights_for_sampler()
            sampler.adapter = weights.adapter
            sampler.wait_for_version(weights.version, timeout=120)
            accuracy = sort_task.accuracy(sampler, task, held_out, weights.version)
            first_accuracy = accuracy
            print(f"after SFT warm-up: v{weights.version}, held-out {accuracy:.3f}", flush=True)
            rewards_seen = []
            for step in range(1, args.steps + 1):
                problems = [task.sample(rng) for _ in range(args.groups_per_step)]
                futures = [sampler.sample_async(sort_task.prompt_ids(p), n=args.group_size,
                                                max_tokens=task.max_tokens)
                           for p, _ in problems]
                datums, rewards = [], []
                for (_, answer), future in zip(problems, futures):
                    group = future.result()
                    group_rewards = [sort_task.reward(s.tokens, answer) for s in group]
                    advantages = flywheel.rl.group_advantages(group_rewards)
                    datums.extend(s.to_datum(a) for s, a in zip(group, advantages))
                    rewards.extend(group_rewards)
                metrics = trainer.forward_backward_custom(datums, loss_fn)
                step_metrics = trainer.optim_step(lr=args.lr)
                weights = trainer.save_weights_for_sampler()
                sampler.wait_for_version(weights.version, timeout=120)
                mean_reward = sum(rewards) / len(rewards)
                rewards_seen.append(mean_reward)
                line = (f"step {step:3d}  v{weights.version}  reward {mean_reward:.3f}  "
                        f"loss {metrics.loss:+.4f}  grad {step_metrics.grad_norm:.3f}")
                if step % args.eval_every == 0 or step == args.steps:
                    accuracy = sort_task.accuracy(sampler, task, held_out, weights.version)
                    line += f"  held-out {accuracy:.3f}"
                print(line + f"  {time.monotonic() - started:.1f} s", flush=True)
        finally:
            sampler.close()
            trainer.close()
            service_client.close()
    tenth = max(1, len(rewards_seen) // 10)
    summary = {"loss": f"reinforce-tis ({args.loss})", "steps": args.steps,
               "warmup_accuracy": first_accuracy, "final_accuracy": accuracy,
               "reward_first_tenth": sum(rewards_seen[:tenth]) / tenth,
               "reward_last_tenth": sum(rewards_seen[-tenth:]) / tenth,
               "wall_seconds": round(time.monotonic() - started, 3)}
    print(json.dumps(summary, indent=2, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
