"""Measure a backbone on the toolworld suite: mean reward and success rate per difficulty level.

    python bench/toolworld_baseline.py --backbone smollm2-135m --split train --per-level 8

Samples `per-level` tasks per difficulty level (1..5 and 6+) evenly over the environments with a seeded
shuffle, rolls them out with the batched engine and prints a JSON report (the table in docs/environments.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from the repository

from lopd_core.backbone import load_backbone
from lopd_core.envs.base import Task
from lopd_core.envs.toolworld import load_toolworld
from lopd_core.rollout import RolloutConfig, RolloutEngine, summarize


def sample_tasks(tasks: list[Task], per_level: int, seed: int = 0) -> list[Task]:
    """`per_level` tasks for each level 1..6 (6 = 6 or more calls), spread round-robin over environments."""
    by_level: dict[int, dict[str, list[Task]]] = defaultdict(lambda: defaultdict(list))
    for task in tasks:
        by_level[min(task.difficulty or 1, 6)][task.env_id].append(task)
    rng = random.Random(seed)
    picked = []
    for level in sorted(by_level):
        pools = {env: rng.sample(items, len(items)) for env, items in sorted(by_level[level].items())}
        chosen: list[Task] = []
        while len(chosen) < per_level and any(pools.values()):
            for env in sorted(pools):
                if pools[env] and len(chosen) < per_level:
                    chosen.append(pools[env].pop())
        picked += chosen
    return picked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="smollm2-135m")
    parser.add_argument("--split", default="train", choices=["train", "eval"])
    parser.add_argument("--per-level", type=int, default=8)
    parser.add_argument("--samples", type=int, default=1, help="rollouts per task")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-turns", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-total-tokens", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the report (and trajectories as .jsonl next to it)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_backbone(args.backbone)
    suite = load_toolworld()
    tasks = sample_tasks(suite.tasks(args.split), args.per_level, args.seed) * args.samples
    config = RolloutConfig(
        temperature=args.temperature,
        top_p=args.top_p,
        max_turns=args.max_turns,
        max_new_tokens=args.max_new_tokens,
        max_total_tokens=args.max_total_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    engine = RolloutEngine(model, tokenizer, config)
    t0 = time.time()
    trajectories = engine.run([suite.episode(t) for t in tasks], desc=f"{args.backbone} on toolworld/{args.split}")
    report = {
        "backbone": args.backbone,
        "split": args.split,
        "tasks": len(tasks) // args.samples,
        "samples_per_task": args.samples,
        "config": vars(args),
        "seconds": round(time.time() - t0, 1),
        "generated_tokens": engine.stats["generated_tokens"],
        **summarize(trajectories),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
        with open(args.out.rsplit(".", 1)[0] + ".jsonl", "w") as fh:
            for t in trajectories:
                fh.write(t.to_json() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
