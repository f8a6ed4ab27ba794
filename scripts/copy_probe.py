"""Does a model read the house code that a solution in its context shows? (OPSD's precondition, docs/study.md)

    python scripts/copy_probe.py MODEL_FOLDER [--suite toolworld-rules-s1] [--difficulties 1] [--n 40]

Replays the reference solutions of the validation slice (validation_fraction 0.2, as the study configs) and prints
`lopd_core.diagnostics.copy_probe` as JSON: `p_shown`, the mean P(shown code), is exactly 1/k for a teacher view that
reads nothing and near 1 for one that copies; `p_shown_right` / `p_shown_wrong` split it by the code shown (a
context-blind model that prefers the right code scores high on the first and low on the second).
"""

from __future__ import annotations

import argparse
import json
import random

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a Hugging Face folder (a warm start) or a backbone name")
    parser.add_argument("--suite", default="toolworld-rules-s1")
    parser.add_argument("--validation-fraction", type=float, default=0.2)
    parser.add_argument("--difficulties", type=int, nargs="*", default=[1])
    parser.add_argument("--n", type=int, default=40, help="validation tasks probed (a seeded sample)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from components.common import open_suite
    from lopd_core.backbone import load_backbone
    from lopd_core.diagnostics import copy_probe
    from lopd_core.serialization import ChatSerializer
    from lopd_core.sft import verified_replays

    torch.set_num_threads(args.threads)
    suite = open_suite(args.suite, args.validation_fraction)
    rules = getattr(suite, "rules", None)
    if rules is None:
        raise SystemExit(
            f"{args.suite!r} has no house rules: the probe needs toolworld-rules[-s<seed>][-k<k>][-digits]"
        )
    tasks = [t for t in suite.tasks("validation") if t.difficulty in set(args.difficulties)]
    tasks = sorted(random.Random(0).sample(tasks, min(args.n, len(tasks))), key=lambda t: t.task_id)
    demos, _ = verified_replays(suite, tasks)
    model, tokenizer = load_backbone(args.model)
    model.eval()
    print(
        json.dumps(
            {"model": args.model, "suite": args.suite, **copy_probe(model, ChatSerializer(tokenizer), rules, demos)}
        )
    )


if __name__ == "__main__":
    main()
