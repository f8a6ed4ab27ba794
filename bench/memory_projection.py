"""What fits on one 80 GB GPU: the step memory model (lopd_core/memory_model.py) projected to the paper's backbones.

One LOPD step at the paper's composer (J = 3 experiences of up to 1024 tokens, K = 32 latents each), a quarter of
the tokens supervised, gradient checkpointing on (what `gradient_checkpointing: auto` does at these lengths), bf16
weights, gradients, AdamW moments and activations (the train step keeps the backbone's dtype throughout; the loss
head's logits are fp32). The trainable parameters are counted on the models themselves, built on the meta
device: the LoRA adapters (`LoraSpec()` defaults) and the QFormer. LoRA students run one replica a GPU (DDP), so
their figure holds for any number of GPUs; full fine-tuning is shown on one GPU and as FSDP2 over 8.

    python bench/memory_projection.py                    # Qwen3-4B and Qwen3-8B at 8k, 16k and 32k tokens
    python bench/memory_projection.py --gpu-gb 141 --backbones Qwen3-8B
Prints one JSON object, then a Markdown table. A projection, not a measurement: see docs/distributed.md for the
CPU points the model was checked against.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from lopd_core.config import LOPDConfig, LoraSpec
from lopd_core.memory_model import CONFIGS, StepShape, backbone_shape, hf_config, largest_tokens, predict_step

RESERVED_GB = 3.0  # CUDA context, NCCL buffers and allocator fragmentation, kept out of the budget


def trainable_counts(name: str, cfg: LOPDConfig) -> tuple[int, int]:
    """(one LoRA adapter's parameters, the composer's trainable parameters: encoder LoRA + QFormer), on meta."""
    from transformers import AutoModelForCausalLM

    from lopd_core.adapters import add_lora
    from lopd_core.composer import QFormer

    config = hf_config(CONFIGS[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        before = sum(p.numel() for p in model.parameters())
        add_lora(model, "student", LoraSpec())
        lora = sum(p.numel() for p in model.parameters()) - before
        qformer = QFormer(config.hidden_size, config.num_attention_heads, cfg.n_queries, cfg.qformer_layers,
                          cfg.qformer_ff_mult)  # fmt: skip
        q = sum(p.numel() for p in qformer.parameters())
    return lora, lora + q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbones", nargs="+", default=["Qwen3-4B", "Qwen3-8B"], choices=list(CONFIGS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--gpu-gb", type=float, default=80.0)
    ap.add_argument("--action-fraction", type=float, default=0.25)
    args = ap.parse_args()
    cfg = LOPDConfig()  # the paper's composer: J, K, encoder_max_tokens
    budget = (args.gpu_gb - RESERVED_GB) * 1e9
    rows = []
    for name in args.backbones:
        bb = backbone_shape(name)
        lora, composer = trainable_counts(name, cfg)
        for student, world in (("lora", 1), ("full", 1), ("full", 8)):
            base = StepShape(
                bb, "lopd", tokens=args.lengths[0], action_tokens=0, latent_tokens=cfg.n_latents,
                encoder_tokens=cfg.n_retrieved * cfg.encoder_max_tokens, student=student, composer=composer,
                trainable=lora if student == "lora" else bb.params, checkpointing=True, dtype_bytes=2,
                world_size=world, chunk_size=cfg.head_chunk_size, device="cuda",
            )  # fmt: skip
            row = {"backbone": name, "student": student, "gpus": world, "largest_tokens": 0, "cells": {}}
            for T in args.lengths:
                p = predict_step(replace(base, tokens=T, action_tokens=int(T * args.action_fraction)))
                row["cells"][T] = {"total_gb": round(p.total / 1e9, 1), "weights_gb": round(p.weights / 1e9, 1),
                                   "fits": p.total <= budget,
                                   "parts_gb": {k: round(v / 1e9, 2) for k, v in p.parts.items()}}  # fmt: skip
            row["largest_tokens"] = largest_tokens(base, budget, args.action_fraction)
            rows.append(row)
    print(json.dumps({"bench": "memory_projection", "gpu_gb": args.gpu_gb, "reserved_gb": RESERVED_GB,
                      "dtype": "bf16", "checkpointing": True, "rows": rows}))  # fmt: skip
    head = " | ".join(f"T = {t // 1024}k" for t in args.lengths)
    print(f"\n| backbone | student | GPUs | {head} | largest T that fits {args.gpu_gb:.0f} GB |")
    print("|---|---|---|" + "---|" * len(args.lengths) + "---|")
    for r in rows:
        cells = " | ".join(
            f"{c['total_gb']} GB {'fits' if c['fits'] else '**does not fit**'}" for c in r["cells"].values()
        )
        mode = "LoRA (DDP: any count)" if r["student"] == "lora" else "full"
        gpus = "1 / rank" if r["student"] == "lora" else (f"FSDP2 x {r['gpus']}" if r["gpus"] > 1 else "1")
        largest = f"{r['largest_tokens'] // 1024}k" if r["largest_tokens"] else "none"
        print(f"| {r['backbone']} | {mode} | {gpus} | {cells} | {largest} |")


if __name__ == "__main__":
    main()
