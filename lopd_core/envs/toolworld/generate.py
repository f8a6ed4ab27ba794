"""Generate the toolworld data files (EnvScaler's JSON layout) from the environment classes and scenario templates.

    python -m lopd_core.envs.toolworld.generate            # rewrite lopd_core/data/toolworld/
    python -m lopd_core.envs.toolworld.generate --check    # exit 1 if the shipped files differ from a regeneration

Deterministic: every scenario draws from its own `random.Random` seeded by a string (suite seed, split,
environment, level, index). Each scenario is verified by simulation before it is kept (this offline script
runs our own environment classes and check functions in-process; the training process never does): every
reference call succeeds, every check passes after the reference solution, and every goal has a check that
fails on the initial state (nothing is already done). The evaluation split is generated first; a training
candidate whose instance (environment, initial state, task) or task text already exists is skipped, so the
splits are disjoint by task id and by generated instance.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib
import json
import random
import sys
from pathlib import Path
from typing import Any

from lopd_core.envs.tools import tools_of_class
from lopd_core.envs.toolworld.scenarios import ENVIRONMENTS, EnvSpec, Goal, World

SEED = "toolworld-v1"
LEVELS = (1, 2, 3, 4, 5, 6)  # number of reference calls; level 6 holds 6 to 8 calls
EVAL_PER_LEVEL = {1: 5, 2: 4, 3: 4, 4: 4, 5: 4, 6: 4}  # per environment: 25 x 8 = 200 evaluation tasks
# More held-out tasks at levels 1-2 (the CPU study's levels), generated after the training split from a seed of
# their own, so the training split is unchanged: 72 -> 552 held-out tasks at levels 1-2 (69 per environment), enough
# for a paired comparison of two methods to detect a few points (issue 41). Ids continue each level's numbering.
EVAL_EXTRA_PER_LEVEL = {1: 30, 2: 30}
TRAIN_PER_LEVEL = {1: 24, 2: 20, 3: 16, 4: 14, 5: 12, 6: 12}  # per environment: 98 x 8 = 784 training tasks
DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "toolworld"
ENV_FILE = "toolworld_env_metadata.json"
SPLIT_FILES = {"train": "toolworld_train_scenarios.json", "eval": "toolworld_eval_scenarios.json"}
SHORT = {spec.env_id: spec.env_id.removeprefix("toolworld_") for spec in ENVIRONMENTS}


def _module(spec: EnvSpec) -> Any:
    return importlib.import_module(f"lopd_core.envs.toolworld.envs.{spec.module}")


def env_item(spec: EnvSpec) -> dict[str, Any]:
    """The environment's metadata item: EnvScaler fields, class source and OpenAI-layout tool schemas."""
    module = _module(spec)
    return {
        "env_id": spec.env_id,
        "environment_summary": module.SUMMARY,
        "environment_introduction": module.INTRODUCTION,
        "constraints_rules": list(module.RULES),
        "env_class_name": spec.class_name,
        "env_class_code": Path(module.__file__).read_text(encoding="utf-8"),
        "tools": env_item_tools(spec),
        "usage_examples": usage_examples(spec),
    }


EXAMPLE_SEED = "toolworld-examples-v1"
MAX_EXAMPLES = 6


def usage_examples(spec: EnvSpec, seed: str = EXAMPLE_SEED) -> list[dict[str, Any]]:
    """One worked single-call example per action tool (task sentence, call, real result) on worlds of their
    own, shown in the system prompt. Scenario tasks that coincide with an example are skipped in `generate`."""
    rng = random.Random(f"{seed}|{spec.env_id}")
    cls = getattr(_module(spec), spec.class_name)
    found: dict[str, dict[str, Any]] = {}
    for _ in range(2000):
        if len(found) >= MAX_EXAMPLES:
            break
        world = World(spec.world(rng))
        goal = rng.choice(spec.goals)(rng, world)
        if goal is None or goal.size != 1 or callable(goal.calls[0]):
            continue
        name, args = goal.calls[0]
        if name in found:
            continue
        env = cls(copy.deepcopy(world.config))
        result = getattr(env, name)(**copy.deepcopy(args))
        if isinstance(result, dict) and result.get("success"):
            found[name] = {"task": goal.text, "call": {"name": name, "arguments": args}, "result": json.dumps(result)}
    order = [t["function"]["name"] for t in env_item_tools(spec)]
    return sorted(found.values(), key=lambda e: order.index(e["call"]["name"]))


def env_item_tools(spec: EnvSpec) -> list[dict[str, Any]]:
    cls = getattr(_module(spec), spec.class_name)
    return [{"type": "function", "function": schema} for schema in tools_of_class(cls)]


def check_source(body: str) -> str:
    return "def check_func(final_state):\n" + "".join(f"    {line}\n" for line in body.splitlines())


def _run_check(source: str, initial: dict[str, Any], final: dict[str, Any]) -> bool:
    namespace: dict[str, Any] = {"initial_state": copy.deepcopy(initial)}
    exec(source, namespace)  # our own generated check, verified offline
    try:
        return namespace["check_func"](copy.deepcopy(final)) is True
    except Exception:
        return False


def _state(env: Any) -> dict[str, Any]:
    return copy.deepcopy({k: v for k, v in vars(env).items() if not (k.startswith("__") and k.endswith("__"))})


def simulate(spec: EnvSpec, config: dict[str, Any], goals: list[Goal]) -> list[dict[str, Any]] | None:
    """Run the goals' reference calls; return the concrete calls if the scenario verifies, else None."""
    cls = getattr(_module(spec), spec.class_name)
    env = cls(copy.deepcopy(config))
    initial = _state(env)
    calls = []
    for goal in goals:
        for step in goal.calls:
            name, args = step(env) if callable(step) else step
            result = getattr(env, name)(**copy.deepcopy(args))
            if not (isinstance(result, dict) and result.get("success")):
                return None
            calls.append({"name": name, "arguments": args})
    final = _state(env)
    for goal in goals:
        sources = [check_source(body) for _, body in goal.checks]
        if not all(_run_check(s, initial, final) for s in sources):
            return None
        if all(_run_check(s, initial, initial) for s in sources):
            return None
    return calls


def compose(spec: EnvSpec, level: int, rng: random.Random) -> tuple[dict[str, Any], list[Goal], list[dict]] | None:
    """One to three goals on disjoint entities whose reference solution has `level` calls (6 to 8 at level 6)."""
    target = rng.choice([6, 7, 8]) if level == 6 else level
    for _ in range(300):
        world = World(spec.world(rng))
        goals: list[Goal] = []
        remaining = target
        for _ in range(80):
            if remaining == 0 or len(goals) == 3:
                break
            goal = rng.choice(spec.goals)(rng, world)
            if goal is None or goal.size > remaining or (len(goals) == 2 and goal.size != remaining):
                continue
            if not goals and target >= 3 and goal.size < 2:
                continue  # harder levels start from a goal whose calls depend on each other
            goals.append(goal)
            world.used |= goal.touches
            remaining -= goal.size
        if remaining:
            continue
        calls = simulate(spec, world.config, goals)
        if calls is not None:
            return world.config, goals, calls
    return None


def task_text(goals: list[Goal]) -> str:
    if len(goals) == 1:
        return goals[0].text
    return "Do the following:\n" + "\n".join(f"{i}. {g.text}" for i, g in enumerate(goals, 1))


def fingerprint(item: dict[str, Any]) -> str:
    """Identity of a generated instance: environment, initial state and task."""
    blob = json.dumps([item["env_id"], item["init_config"], item["task"]], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def scenario_item(spec: EnvSpec, task_id: str, config: dict, goals: list[Goal], calls: list[dict]) -> dict[str, Any]:
    checks = [(item, check_source(body)) for g in goals for item, body in g.checks]
    return {
        "env_id": spec.env_id,
        "env_class_name": spec.class_name,
        "task_id": task_id,
        "init_config": config,
        "task": task_text(goals),
        "checklist": [item for item, _ in checks],
        "checklist_with_func": [{"check_item": item, "check_func": src} for item, src in checks],
        "difficulty": len(calls),
        "reference_solution": calls,
    }


def generate(seed: str = SEED) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    env_items = {spec.env_id: env_item(spec) for spec in ENVIRONMENTS}
    example_tasks = {(env_id, e["task"]) for env_id, item in env_items.items() for e in item["usage_examples"]}
    seen_instances: set[str] = set()
    seen_tasks: set[tuple[str, str]] = set()
    splits: dict[str, list[dict[str, Any]]] = {"eval": [], "train": []}

    def draw(spec: EnvSpec, level: int, n: int, stream: str, split: str, first: int) -> list[dict[str, Any]]:
        """n scenarios of `spec` at `level` from the seed stream `stream`, numbered from `first`, none repeating an
        instance or a task text seen so far (in any split, or among the prompt examples)."""
        out: list[dict[str, Any]] = []
        index = 0
        while len(out) < n:
            index += 1
            if index > n * 20:
                raise RuntimeError(f"cannot generate enough {split} scenarios for {spec.env_id} level {level}")
            composed = compose(spec, level, random.Random(f"{stream}|{spec.env_id}|{level}|{index}"))
            if composed is None:
                continue
            task_id = f"tw-{split}-{SHORT[spec.env_id]}-d{level}-{first + len(out):03d}"
            item = scenario_item(spec, task_id, *composed)
            key = (item["env_id"], item["task"])
            if fingerprint(item) in seen_instances or key in seen_tasks or key in example_tasks:
                continue
            seen_instances.add(fingerprint(item))
            seen_tasks.add(key)
            out.append(item)
        return out

    for split, per_level in (("eval", EVAL_PER_LEVEL), ("train", TRAIN_PER_LEVEL)):
        for spec in ENVIRONMENTS:
            for level in LEVELS:
                splits[split] += draw(spec, level, per_level[level], f"{seed}|{split}", split, 1)
    for spec in ENVIRONMENTS:  # the extra held-out tasks: disjoint from both splits by instance and task text
        for level, n in EVAL_EXTRA_PER_LEVEL.items():
            splits["eval"] += draw(spec, level, n, f"{seed}|eval-extra", "eval", EVAL_PER_LEVEL[level] + 1)
    return env_items, {"train": splits["train"], "eval": splits["eval"]}


POOL_SEED = "toolworld-pool-v1"


def training_pool(
    per_level: int, levels: tuple[int, ...] = LEVELS, seed: str = POOL_SEED, data_dir: Path = DATA_DIR
) -> list[dict[str, Any]]:
    """More training-distribution scenarios for demonstrations (the sft stage): `per_level` per environment and
    level, ids `tw-pool-...`, drawn from their own seed stream. Disjoint from every shipped scenario: a
    candidate whose instance (environment, initial state, task) or task text equals one of the held-out split,
    of the training split (which holds the validation slice) or of the prompt examples is skipped; pool items
    are distinct instances but may repeat a task text among themselves (different worlds).
    """
    known = [item for name in SPLIT_FILES.values() for item in json.loads((data_dir / name).read_text())]
    examples = {(spec.env_id, e["task"]) for spec in ENVIRONMENTS for e in usage_examples(spec)}
    seen_instances = {fingerprint(item) for item in known}
    known_tasks = {(item["env_id"], item["task"]) for item in known} | examples
    pool: list[dict[str, Any]] = []
    for spec in ENVIRONMENTS:
        for level in levels:
            made, index = 0, 0
            while made < per_level:
                index += 1
                if index > per_level * 20:
                    raise RuntimeError(f"cannot generate {per_level} pool scenarios for {spec.env_id} level {level}")
                composed = compose(spec, level, random.Random(f"{seed}|{spec.env_id}|{level}|{index}"))
                if composed is None:
                    continue
                item = scenario_item(spec, f"tw-pool-{SHORT[spec.env_id]}-d{level}-{made + 1:04d}", *composed)
                if fingerprint(item) in seen_instances or (item["env_id"], item["task"]) in known_tasks:
                    continue  # pool items may share a task text among themselves, never with a shipped one
                seen_instances.add(fingerprint(item))
                pool.append(item)
                made += 1
    return pool


def dumps_items(items: list[Any] | dict[str, Any]) -> str:
    """JSON with one item per line: valid JSON, compact, and line-by-line diffable."""
    if isinstance(items, dict):
        body = ",\n".join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in items.items())
        return "{\n" + body + "\n}\n"
    return "[\n" + ",\n".join(json.dumps(item, ensure_ascii=False) for item in items) + "\n]\n"


def render(seed: str = SEED) -> dict[str, str]:
    """File name -> file text of the whole data set."""
    env_items, splits = generate(seed)
    files = {ENV_FILE: dumps_items(env_items)}
    for split, name in SPLIT_FILES.items():
        files[name] = dumps_items(splits[split])
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="output folder (default: the shipped data)")
    parser.add_argument("--check", action="store_true", help="compare with the files in --out instead of writing")
    args = parser.parse_args(argv)
    files = render()
    if args.check:
        stale = [n for n, text in files.items() if not (args.out / n).exists() or (args.out / n).read_text() != text]
        for name in stale:
            print(f"{args.out / name} differs from a regeneration", file=sys.stderr)
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text, encoding="utf-8")
        print(f"wrote {args.out / name} ({len(text.encode()) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
