#!/usr/bin/env python3
"""GRPO on the demo's sort task, written on the user side of the training service.

The script owns the RL loop; the service only trains and serves: rollout workers sample
groups (flywheel.SamplingClient), this script scores them and computes group advantages,
the training service runs `forward_backward` (loss ppo with truncated importance sampling
against the sampling logprobs) and `optim_step`, and `save_weights_for_sampler` publishes
the new policy to the workers. Held-out accuracy (greedy) is measured on the workers every
few steps; the run stops at the target accuracy or the time limit.

Settings are the demo's (pipeline/run_config.h, pipeline/demo.cc): sort of 6 digits, an SFT
warm-up of 30 steps (batch 32, lr 1e-3), then GRPO with groups of 8, 8 groups a step,
lr 5e-5, clip 0.2, TIS cap 2, gradient clip 1, seq-mean-token-mean aggregation.

    examples/rl_sort.py --launch     # starts `flywheel service` (--flywheel, $FLYWHEEL_BIN,
                                     # PATH, or this checkout's build/bin/flywheel)
    examples/rl_sort.py --service flywheel-runs/service-1         # its service.json
    examples/rl_sort.py --trainer http://127.0.0.1:7300 --workers http://127.0.0.1:7280 \\
        --token-file token

Prints a line per step and a JSON summary at the end (time to the target, steps, accuracy).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time

import sort_task
from sort_task import SortTask, flywheel


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sort_task.add_service_arguments(parser)
    run = parser.add_argument_group("run")
    run.add_argument("--time-limit", type=float, default=600.0, help="seconds (default 600)")
    run.add_argument("--target", type=float, default=0.8,
                     help="held-out accuracy to stop at (0: none, run --max-steps)")
    run.add_argument("--max-steps", type=int, default=5000)
    run.add_argument("--eval-every", type=int, default=5, help="steps between evaluations")
    run.add_argument("--eval-prompts", type=int, default=256)
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--digits", type=int, default=6)
    run.add_argument("--session-name", default=None, help="the session's (adapter's) name")
    algo = parser.add_argument_group("algorithm (the demo's defaults)")
    algo.add_argument("--group-size", type=int, default=8)
    algo.add_argument("--groups-per-step", type=int, default=8)
    algo.add_argument("--lr", type=float, default=5e-5)
    algo.add_argument("--clip", type=float, default=0.2)
    algo.add_argument("--tis-cap", type=float, default=2.0)
    algo.add_argument("--grad-clip", type=float, default=1.0)
    algo.add_argument("--temperature", type=float, default=1.0)
    algo.add_argument("--max-staleness", type=int, default=1,
                      help="batches sampled ahead of training (0: on-policy, wait for every "
                           "new version before sampling)")
    sft = parser.add_argument_group("SFT warm-up")
    sft.add_argument("--sft-steps", type=int, default=30)
    sft.add_argument("--sft-batch", type=int, default=32)
    sft.add_argument("--sft-lr", type=float, default=1e-3)
    return parser.parse_args(argv)


def say(text: str) -> None:
    print(text, flush=True)


class Run:
    def __init__(self, args: argparse.Namespace, service: sort_task.Service):
        self.args = args
        self.task = SortTask(args.digits)
        self.rng = random.Random(args.seed)
        self.held_out = self.task.held_out(args.eval_prompts)
        self.service_client = flywheel.ServiceClient(service.trainer, service.token)
        info = self.service_client.info()
        sort_task.check_model(info)
        say(f"training service {service.trainer}: mode {info.get('mode')}, "
            f"{(info.get('parameters') or {}).get('trainable', '?')} trainable parameters; "
            f"workers {', '.join(service.workers)}")
        self.trainer = self.service_client.create_session(name=args.session_name)
        self.sampler = flywheel.SamplingClient(service.workers, service.token)
        self.started = time.monotonic()
        self.version = 0
        self.samples = 0
        self.history = []

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def publish(self) -> int:
        """Publishes the trainer's weights; the sampler follows the session's adapter (LoRA)."""
        weights = self.trainer.save_weights_for_sampler()
        self.sampler.adapter = weights.get("adapter")
        self.version = int(weights.version)
        return self.version

    def warm_up(self) -> None:
        """The demo's SFT warm-up: cross-entropy on (prompt, answer) pairs of the training
        part. The calls are pipelined (async); the server runs them in order."""
        args = self.args
        if args.sft_steps <= 0:
            return
        rng = random.Random(args.seed + 99)
        pool = [sort_task.sft_datum(*self.task.sample(rng)) for _ in range(4000)]
        futures = []
        for _ in range(args.sft_steps):
            batch = [pool[self.rng.randrange(len(pool))] for _ in range(args.sft_batch)]
            futures.append(self.trainer.forward_backward_async(batch, loss="cross_entropy"))
            futures.append(self.trainer.optim_step_async(lr=args.sft_lr, grad_clip=args.grad_clip))
        losses = [f.result().loss for f in futures[0::2]]
        for future in futures[1::2]:
            future.result()
        say(f"sft  {args.sft_steps} steps  loss {losses[0]:.3f} -> {losses[-1]:.3f}  "
            f"{self.elapsed():.1f} s")

    def evaluate(self) -> float:
        return sort_task.accuracy(self.sampler, self.task, self.held_out, min_version=self.version)

    def launch_batch(self, min_version: int):
        """Sampling futures for one step: groups_per_step prompts x group_size samples."""
        problems = [self.task.sample(self.rng) for _ in range(self.args.groups_per_step)]
        futures = [self.sampler.sample_async(
            sort_task.prompt_ids(prompt), n=self.args.group_size, max_tokens=self.task.max_tokens,
            temperature=self.args.temperature, min_version=min_version)
            for prompt, _ in problems]
        return problems, futures

    def datums_of(self, problems, futures):
        """Scores the groups; returns (datums, mean reward, mean staleness in versions)."""
        datums, rewards_all, staleness = [], [], []
        for (_, answer), future in zip(problems, futures):
            group = future.result()
            rewards = [sort_task.reward(s.tokens, answer) for s in group]
            advantages = flywheel.rl.group_advantages(rewards)
            datums.extend(s.to_datum(a) for s, a in zip(group, advantages))
            rewards_all.extend(rewards)
            staleness.extend(self.version - v for s in group for v in s.policy_versions)
        self.samples += len(rewards_all)
        return (datums, sum(rewards_all) / len(rewards_all),
                sum(staleness) / max(len(staleness), 1))

    def train(self) -> dict:
        args = self.args
        self.warm_up()
        self.sampler.wait_for_version(self.publish(), timeout=120)
        initial = self.evaluate()
        say(f"v{self.version}: held-out accuracy {initial:.3f} ({len(self.held_out)} prompts)  "
            f"{self.elapsed():.1f} s")
        accuracy, step = initial, 0
        reached_at = self.elapsed() if args.target > 0 and initial >= args.target else None
        pending = collections.deque()
        while (step < args.max_steps and self.elapsed() < args.time_limit
               and (args.target <= 0 or accuracy < args.target)):
            step += 1
            while len(pending) <= args.max_staleness:
                pending.append(self.launch_batch(max(0, self.version - args.max_staleness)))
            datums, mean_reward, staleness = self.datums_of(*pending.popleft())
            fb = self.trainer.forward_backward_async(
                datums, loss="ppo", aggregation="seq-mean-token-mean", clip_low=args.clip,
                clip_high=args.clip, tis_cap=args.tis_cap)
            opt = self.trainer.optim_step_async(lr=args.lr, grad_clip=args.grad_clip)
            version = self.publish()
            if args.max_staleness == 0:
                self.sampler.wait_for_version(version, timeout=120)
            metrics, step_metrics = fb.result(), opt.result()
            line = (f"step {step:4d}  v{version}  reward {mean_reward:.3f}  "
                    f"loss {metrics.loss:+.4f}  k3 {metrics.kl_sampler_k3:.5f}  "
                    f"clip {metrics.clip_fraction:.3f}  grad {step_metrics.grad_norm:.3f}  "
                    f"stale {staleness:.2f}")
            if step % args.eval_every == 0:
                self.sampler.wait_for_version(version, timeout=120, all_workers=False)
                accuracy = self.evaluate()
                line += f"  held-out {accuracy:.3f}"
                if args.target > 0 and accuracy >= args.target and reached_at is None:
                    reached_at = self.elapsed()
            self.history.append({"step": step, "version": version, "reward": mean_reward,
                                 "accuracy": accuracy if step % args.eval_every == 0 else None,
                                 "wall_s": round(self.elapsed(), 3)})
            say(line + f"  {self.elapsed():.1f} s")
        for problems, futures in pending:  # let sampling in flight finish before closing
            for future in futures:
                future.exception()
        return {"task": f"sort-{args.digits}", "reached_target": reached_at is not None,
                "target_accuracy": args.target, "time_to_target_s": reached_at,
                "steps": step, "final_accuracy": accuracy, "warmup_accuracy": initial,
                "samples": self.samples, "versions": self.version,
                "wall_seconds": round(self.elapsed(), 3), "max_staleness": args.max_staleness,
                "group_size": args.group_size, "groups_per_step": args.groups_per_step,
                "lr": args.lr, "session": self.trainer.session_id}

    def close(self) -> None:
        self.sampler.close()
        self.trainer.close()
        self.service_client.close()


def main(argv=None) -> int:
    args = parse_arguments(argv)
    with sort_task.Service.from_arguments(args, say) as service:
        run = Run(args, service)
        try:
            summary = run.train()
        finally:
            run.close()
    print(json.dumps(summary, indent=2, sort_keys=True), flush=True)
    return 0 if summary["reached_target"] or args.target <= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
