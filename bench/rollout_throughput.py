"""Rollout throughput: the batched engine vs one-at-a-time Hugging Face `generate`, same model, same tasks.

    python bench/rollout_throughput.py                                  # SmolLM2-135M, 16 toolworld tasks
    python bench/rollout_throughput.py --backbone tiny --tasks 8        # seconds, for a smoke run
    python bench/rollout_throughput.py --engine hf,sequential,vllm --vllm-compile   # vLLM beside both HF sides

Both sides run the same episodes through the same engine loop (prompts, environment steps, scoring); only
the generation differs:

* batched: `RolloutEngine.generate`, up to --batch-size episodes per forward, KV cache, finished rows dropped,
  keys/values reused across turns and across episodes sharing a system prompt (`--no-reuse` turns that off);
* sequential: `model.generate(...)` (Hugging Face, KV cache within the call) for one prompt at a time, each
  turn re-encoding the whole conversation, as a plain per-episode loop would.

* vllm: `VllmRolloutEngine` (rollout.engine=vllm; a vLLM worker process, `make venv-vllm`). Its start-up
  (worker, model load, compile with --vllm-compile) and the weight sync (merge + load into the running
  engine, as after each train step) are reported apart; the rollout is run twice and the second run is the
  steady-state figure (`vllm`), the first is `vllm_first_run`.

Decoding is greedy by default so both sides produce (nearly) the same tokens; the figure of merit is
generated tokens per second of wall time.

`roofline`: the floor on a decode step's time on this machine at the batched engine's mean batch B and mean
context c, from what a step must do: read every weight once (the tied embedding is the output layer) and each
row's keys and values, and compute 2 FLOPs per weight per row plus the attention's 4·layers·d·c. The machine's
limits are measured here, at the same thread count: a large tensor copy (bytes read and written per second) and
a 1024² fp32 matrix product (FLOP/s). The ceiling is B / max(bytes / bandwidth, FLOPs / FLOP rate) tokens per
second, and each engine's measured rate is printed as a fraction of it. Prints one JSON object (and writes it
with --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.toolworld_baseline import sample_tasks
from lopd_core.backbone import load_backbone
from lopd_core.envs.toolworld import load_toolworld
from lopd_core.rollout import Generation, RolloutConfig, RolloutEngine


class SequentialHFEngine(RolloutEngine):
    """The same engine loop, generating with `model.generate` one prompt at a time (the baseline)."""

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int],
        generator: torch.Generator | None = None,
        pasts: Sequence[object] | None = None,
    ) -> list[Generation]:
        cfg = self.config
        outputs = []
        for prompt, budget in zip(prompts, max_new_tokens, strict=True):
            ids = torch.tensor([list(prompt)], device=self.model.device)
            sampling = (
                {"do_sample": False}
                if cfg.temperature == 0
                else {
                    "do_sample": True,
                    "temperature": cfg.temperature,
                    "top_p": cfg.top_p,
                    "top_k": 0,
                }
            )
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=int(budget),
                eos_token_id=sorted(self.stop_ids),
                pad_token_id=self.pad_id,
                **sampling,
            )
            self.stats["forward_passes"] += out.shape[1] - ids.shape[1]
            self.stats["prefilled_tokens"] = self.stats.get("prefilled_tokens", 0) + len(prompt)
            new = out[0, ids.shape[1] :].tolist()
            if new and new[-1] in self.stop_ids:
                outputs.append(Generation(new[:-1], truncated=new[-1] != self.end_of_turn_id))
            else:
                outputs.append(Generation(new, truncated=True))
        return outputs


def measure(engine: RolloutEngine, tasks: list, suite) -> dict:
    t0 = time.perf_counter()
    trajectories = engine.run([suite.episode(t) for t in tasks], desc=type(engine).__name__)
    seconds = time.perf_counter() - t0
    tokens = engine.stats["generated_tokens"]
    return {
        "episodes": len(trajectories),
        "turns": sum(t.n_turns for t in trajectories),
        "generated_tokens": tokens,
        "prefilled_tokens": engine.stats.get("prefilled_tokens", 0),
        "prompt_tokens": engine.stats.get("prompt_tokens", 0),
        "forward_passes": engine.stats.get("forward_passes", 0),
        "seconds": round(seconds, 2),
        "generate_seconds": round(engine.stats["generate_s"], 2),
        "tokens_per_s": round(tokens / seconds, 2),
        "mean_reward": round(sum(t.reward for t in trajectories) / len(trajectories), 4),
    }


def machine_limits(repeats: int = 5) -> dict:
    """This machine's memory bandwidth (a 256 MB fp32 copy, bytes read + written) and fp32 matrix-product rate,
    at torch's current thread count; the best of `repeats`."""
    src, dst = torch.ones(64 * 2**20), torch.empty(64 * 2**20)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    copies, products = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.mm(a, b)
        products.append(time.perf_counter() - t0)
    return {"bandwidth_gb_s": round(2 * src.numel() * 4 / min(copies) / 1e9, 2),
            "matmul_gflop_s": round(2 * 1024**3 / min(products) / 1e9, 2)}  # fmt: skip


def roofline(model, batched: dict, limits: dict) -> dict:  # type: ignore[no-untyped-def]
    """The floor on decode time at the batched engine's mean batch and context (see the module docstring)."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    width = next(model.parameters()).element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * width  # bytes per context token
    rows = batched["generated_tokens"] / max(batched["forward_passes"], 1)  # B: rows per decode forward
    context = (batched["prompt_tokens"] + batched["generated_tokens"] / 2) / max(batched["turns"], 1)  # c
    step_bytes = params * width + rows * context * kv_per_token
    step_flops = rows * (2 * params + 4 * cfg.num_hidden_layers * cfg.hidden_size * context)
    memory_s = step_bytes / (limits["bandwidth_gb_s"] * 1e9)
    compute_s = step_flops / (limits["matmul_gflop_s"] * 1e9)
    return {
        **limits,
        "mean_batch": round(rows, 2),
        "mean_context_tokens": round(context, 1),
        "bytes_per_token": round(step_bytes / rows),
        "flops_per_token": round(step_flops / rows),
        "bound": "memory" if memory_s >= compute_s else "compute",
        "ceiling_tokens_per_s": round(rows / max(memory_s, compute_s), 1),
    }


def measure_vllm(model, tokenizer, config: RolloutConfig, tasks: list, suite, compile_: bool) -> dict:

    from lopd_core.vllm_engine import VllmRolloutEngine

    t0 = time.perf_counter()
    engine = VllmRolloutEngine(model, tokenizer, config.model_copy(update={"engine": "vllm", "vllm_compile": compile_}))
    out: dict = {"vllm_startup_s": round(time.perf_counter() - t0, 2), "vllm_compiled": compile_}
    try:
        out["vllm_first_run"] = measure(engine, tasks, suite)
        syncs = [engine.sync(model) for _ in range(3)]
        out["vllm"] = measure(engine, tasks, suite)
        n_params = sum(p.numel() for p in model.parameters())
        step = out["vllm"]["seconds"] + min(syncs)
        out["vllm_sync"] = {
            "seconds": [round(x, 3) for x in syncs],
            "parameters": n_params,
            "share_of_rollout_plus_sync": round(min(syncs) / step, 4),
        }
    finally:
        engine.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="smollm2-135m")
    parser.add_argument("--tasks", type=int, default=16, help="toolworld training tasks (spread over levels)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-reuse", action="store_true", help="batched engine without cache reuse")
    parser.add_argument("--skip-sequential", action="store_true")
    parser.add_argument("--engine", default="hf,sequential", help="comma list of hf, sequential, vllm")
    parser.add_argument("--vllm-compile", action="store_true", help="vLLM with torch.compile instead of eager")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_backbone(args.backbone)
    suite = load_toolworld()
    picked = sample_tasks(suite.tasks("train"), -(-args.tasks // 6), seed=0)
    by_level: dict[int, list] = {}
    for task in picked:
        by_level.setdefault(min(task.difficulty, 6), []).append(task)
    rounds = zip(*by_level.values(), strict=False)  # interleave levels: 1, 2, ..., 6, 1, 2, ...
    tasks = [task for group in rounds for task in group][: args.tasks]
    config = RolloutConfig(
        temperature=args.temperature,
        top_p=args.top_p,
        max_turns=args.max_turns,
        max_new_tokens=args.max_new_tokens,
        max_total_tokens=8192,
        batch_size=args.batch_size,
        reuse_cache=not args.no_reuse,
        progress=True,
    )
    report: dict = {
        "backbone": args.backbone,
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "tasks": len(tasks),
        "config": {
            k: getattr(config, k)
            for k in ("temperature", "top_p", "max_turns", "max_new_tokens", "batch_size", "reuse_cache")
        },
    }
    engines = set(args.engine.split(","))
    if engines - {"hf", "sequential", "vllm"}:
        parser.error(f"unknown engine(s) {sorted(engines - {'hf', 'sequential', 'vllm'})}")

    def save() -> None:  # after each engine, so a long run leaves its figures so far
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")

    if "hf" in engines:
        report["batched"] = measure(RolloutEngine(model, tokenizer, config), tasks, suite)
        save()
    if "vllm" in engines:
        report.update(measure_vllm(model, tokenizer, config, tasks, suite, args.vllm_compile))
        save()
    if "sequential" in engines and not args.skip_sequential:
        sequential = RolloutConfig(
            **{**report["config"], "batch_size": 1, "reuse_cache": False, "max_total_tokens": 8192}
        )
        report["sequential_hf_generate"] = measure(SequentialHFEngine(model, tokenizer, sequential), tasks, suite)
    base = report.get("sequential_hf_generate", {}).get("tokens_per_s")
    if base and "batched" in report:
        report["speedup"] = round(report["batched"]["tokens_per_s"] / base, 2)
    if "vllm" in report and "batched" in report:
        report["vllm_over_batched"] = round(report["vllm"]["tokens_per_s"] / report["batched"]["tokens_per_s"], 2)
    if "vllm" in report and base:
        report["vllm_over_sequential"] = round(report["vllm"]["tokens_per_s"] / base, 2)
    if "batched" in report:  # the floor at the batched engine's batch and context, each engine against it
        line = report["roofline"] = roofline(model, report["batched"], machine_limits())
        for name in ("batched", "vllm", "sequential_hf_generate"):
            if name in report:
                line[f"{name}_of_ceiling"] = round(report[name]["tokens_per_s"] / line["ceiling_tokens_per_s"], 3)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
