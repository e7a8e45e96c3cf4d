#!/usr/bin/env python3
"""Train a tiny PyTorch language model and push every step to a flywheel publisher.

After each optimizer step the weights are pushed (as bf16, with HF-style tensor names,
metadata {step, loss}) and the script waits until the fleet serves that version. One line
per step: version, loss, upload kind (full or delta) and bytes, push time and the time
from the commit until the workers serve it. Exits non-zero on any failure.

    PYTHONPATH=python examples/train_and_push.py --url http://127.0.0.1:7080 \\
        --token-file push.token --steps 5

Uses only the public API of the `flywheel` package (python/). With a `flywheel` binary
($FLYWHEEL_BIN or PATH) the second push onward are deltas.
"""

import argparse
import sys
import time

import torch
from torch import nn

import flywheel


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.input_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, vocab: int, hidden: int, intermediate: int, layers: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, intermediate) for _ in range(layers))
        self.norm = RMSNorm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TinyLM(nn.Module):
    """A gated-MLP language model whose state_dict names follow Llama's
    (``model.layers.0.mlp.up_proj.weight``, ``lm_head.weight``)."""

    def __init__(self, vocab: int = 256, hidden: int = 128, intermediate: int = 256,
                 layers: int = 2):
        super().__init__()
        self.model = Backbone(vocab, hidden, intermediate, layers)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))


def batch(generator: torch.Generator, vocab: int, size: int = 32, length: int = 16):
    """The task: predict the next token of a sequence counting up modulo the vocabulary."""
    start = torch.randint(0, vocab, (size, 1), generator=generator)
    sequence = (start + torch.arange(length + 1)) % vocab
    return sequence[:, :-1], sequence[:, 1:]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the publisher's HTTP address")
    parser.add_argument("--token-file", help="file holding the push token")
    parser.add_argument("--ca-file", help="CA bundle for an https publisher")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (one push each)")
    parser.add_argument("--wait", type=float, default=1.0,
                        help="fraction of the workers that must serve each version")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds each version may take to be served")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    token = None
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as token_file:
            token = token_file.read().strip()
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = model.lm_head.out_features
    with flywheel.Client(args.url, token, ca_file=args.ca_file) as client:
        for step in range(1, args.steps + 1):
            inputs, targets = batch(generator, vocab)
            logits = model(inputs).reshape(-1, vocab)
            loss = nn.functional.cross_entropy(logits, targets.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            started = time.monotonic()
            row = client.push(model.state_dict(), metadata={"step": step, "loss": loss.item()})
            committed = time.monotonic()
            client.wait_serving(row["version"], fraction=args.wait, timeout=args.timeout)
            served = time.monotonic()
            print(f"step {step}: version {row['version']} loss {loss.item():.4f} "
                  f"{row.get('upload_kind')} {row.get('uploaded_bytes')} bytes uploaded, "
                  f"push {committed - started:.2f} s, serving after {served - committed:.2f} s",
                  flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (flywheel.FlywheelError, OSError, ValueError) as error:
        print(f"train_and_push: {type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(1)
