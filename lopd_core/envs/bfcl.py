"""BFCL-v3 multi-turn as a suite: the `nvidia-bfcl` package's tasks, backend classes and checker.

Four subsets of 200 tasks each (the ones the LOPD paper averages):
- `base`: every user turn can be fulfilled with the documented functions;
- `miss_func`: some functions are held out of the system prompt; the turn whose request needs them has no
  ground-truth call, and an extra user turn (empty in BFCL's data) reveals them at the turn BFCL names;
- `miss_param`: a request lacks a value; its turn has no ground-truth call and the next user turn gives it;
- `long_context`: the base requests with the backends loaded in long-context mode (large directories, long
  files and records, long tool outputs).
Every task is split "eval": BFCL tasks must never enter a training bank.

An episode plays the user turns in order. Assistant actions use the shared format (`lopd_core.envs.actions`):
calls are executed against fresh instances of the package's backend classes with the package's own
`execute_multi_turn_func_call`, and their results come back as tool messages; an action without a call ends the
current user turn (the next user turn follows, or the episode is done after the last one). `result()` runs the
package's `multi_turn_checker` over the calls executed per turn: after every turn with ground-truth calls, the
state of every backend instance must equal the ground-truth instance's state (public attributes) and every
ground-truth call's result must appear among the results of the model's calls so far (an unordered
multiset check). Reward is 1.0 when it passes, else 0.0.

BFCL caches backend instances in a module-level dict keyed by model name and task id, so each episode and
each `result()` call uses its own unique model name, deep-copies the instances it creates (long-context
TravelAPI shares module-level dicts between instances) and removes its cache entries when it no longer
needs them.

The package is imported lazily; install it with `pip install --no-deps nvidia-bfcl==26.3 mpmath`.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import inspect
import itertools
import json
import keyword
import re
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

from lopd_core.conversation import Message
from lopd_core.envs.actions import ToolCall, format_call, parse_action
from lopd_core.envs.base import SPLITS, EpisodeResult, StepResult, Task

SUITE_NAME = "bfcl-v3"
SUBSETS: tuple[str, ...] = ("base", "miss_func", "miss_param", "long_context")
MAX_STEPS_PER_TURN = 20  # BFCL's MAXIMUM_STEP_LIMIT
INSTALL_HINT = "pip install --no-deps nvidia-bfcl==26.3 mpmath"
_EXEC_ERROR_PREFIX = "Error during execution:"
_DETAIL_CHARS = 400

# BFCL's function docs use Python-ish type names; the system prompt shows JSON schema types.
_JSON_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string", "bool": "boolean"}

SYSTEM_PROMPT = """You are an assistant that fulfils the user's requests by calling functions.

Available functions (JSON schemas, one per line):
{functions}

To call functions, reply with one JSON object per call, each wrapped in <tool_call></tool_call> tags:
<tool_call>{{"name": "function_name", "arguments": {{"parameter": "value"}}}}</tool_call>
You may make several calls in one reply; they run in order and you then see each call's result. Keep calling
functions until the user's current request is fulfilled. Then reply with a short plain-text message and no
function call: that ends your turn, and the user may follow up. If the request cannot be fulfilled with the
available functions, or a required value is missing, say so in plain text without calling a function."""

REVEAL_PROMPT = "New functions are available (JSON schemas, one per line):\n{functions}\n{sentence}"


# ---------------------------------------------------------------------------------------------------------------
# The package, imported lazily


class _Package:
    """Handles on the parts of `bfcl` the adapter uses."""

    def __init__(self) -> None:
        try:
            import bfcl
            import mpmath  # noqa: F401  (the MathAPI backend needs it)
            from bfcl.constant import MULTI_TURN_FUNC_DOC_FILE_MAPPING
            from bfcl.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils
            from bfcl.model_handler.constant import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
        except ImportError as exc:
            raise ImportError(
                f"The {SUITE_NAME} suite needs the nvidia-bfcl package (module `bfcl`) and mpmath: {INSTALL_HINT}"
            ) from exc
        self.data_dir = Path(bfcl.__file__).parent / "data"
        self.func_doc_files: dict[str, str] = dict(MULTI_TURN_FUNC_DOC_FILE_MAPPING)
        self.utils: ModuleType = multi_turn_utils
        self.checker: ModuleType = multi_turn_checker
        self.reveal_sentence: str = DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC

    def backend_class(self, class_name: str) -> type:
        module = importlib.import_module(self.utils.CLASS_FILE_PATH_MAPPING[class_name])
        return getattr(module, class_name)

    def execute(self, calls: list[str], entry: dict[str, Any], model_name: str, eval_run: bool) -> list[str]:
        results, _ = self.utils.execute_multi_turn_func_call(
            func_call_list=calls,
            initial_config=entry["initial_config"],
            involved_classes=entry["involved_classes"],
            model_name=model_name,
            test_entry_id=entry["id"],
            long_context=_is_long_context(entry["id"]),
            is_evaL_run=eval_run,
        )
        return results

    def create_isolated(self, entry: dict[str, Any], model_name: str, eval_run: bool) -> None:
        """Create the backend instances BFCL will find under `model_name`, each a private deep copy."""
        self.execute([], entry, model_name, eval_run)
        prefix = f"{model_name}{'_eval' if eval_run else ''}_{entry['id']}_"
        cache = vars(self.utils)  # list(cache) snapshots the keys at once, so other threads' episodes may run
        for key in [k for k in list(cache) if k.startswith(prefix) and k.endswith("_instance")]:
            cache[key] = copy.deepcopy(cache[key])

    def release(self, model_name: str) -> None:
        """Drop every cached backend instance whose model name starts with `model_name`."""
        cache = vars(self.utils)
        for key in [k for k in list(cache) if k.startswith(model_name + "_") and k.endswith("_instance")]:
            cache.pop(key, None)


@functools.cache
def _package() -> _Package:
    return _Package()


def _is_long_context(task_id: str) -> bool:
    category = task_id.rsplit("_", 1)[0]
    return "long_context" in category or "composite" in category  # as in BFCL's handlers and checker


# ---------------------------------------------------------------------------------------------------------------
# Data


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _to_json_schema(node: Any) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "type" and isinstance(value, str):
                out[key] = _JSON_TYPES.get(value, value)
            else:
                out[key] = _to_json_schema(value)
        return out
    if isinstance(node, list):
        return [_to_json_schema(v) for v in node]
    return node


@functools.cache
def _func_docs(data_dir: str, doc_file: str) -> tuple[dict[str, Any], ...]:
    """One backend class's functions as JSON schemas {"name", "description", "parameters"}."""
    docs = _read_jsonl(Path(data_dir) / "multi_turn_func_doc" / doc_file)
    return tuple(
        {"name": d["name"], "description": d["description"], "parameters": _to_json_schema(d["parameters"])}
        for d in docs
    )


@functools.cache
def _load_subset(data_dir: str, subset: str) -> dict[str, tuple[dict[str, Any], list[list[str]]]]:
    """task id -> (BFCL test entry, ground truth: per turn, the call strings)."""
    root = Path(data_dir)
    entries = _read_jsonl(root / f"BFCL_v3_multi_turn_{subset}.json")
    answer_file = root / "possible_answer" / f"BFCL_v3_multi_turn_{subset}.json"
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(answer_file)}
    out = {}
    for entry in entries:
        truth = answers[entry["id"]]
        if len(truth) != len(entry["question"]):
            raise ValueError(f"BFCL task {entry['id']}: {len(entry['question'])} turns but {len(truth)} answer turns")
        out[entry["id"]] = (entry, truth)
    return out


def _schemas_text(schemas: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)


def _turn_text(messages: list[dict[str, Any]]) -> str:
    return "\n\n".join(m["content"] for m in messages if m.get("content"))


# ---------------------------------------------------------------------------------------------------------------
# Calls: JSON actions -> BFCL call strings, and the ground truth back to JSON


def _call_source(call: ToolCall) -> str:
    """A BFCL call string; argument names are checked identifiers and values JSON data, so repr() is a literal."""
    args = ", ".join(f"{name}={value!r}" for name, value in call.arguments.items())
    return f"{call.name}({args})"


def _parse_call_source(source: str, signatures: dict[str, inspect.Signature]) -> ToolCall:
    """A ground-truth call string such as "sort('a.txt')" as a ToolCall with keyword arguments."""
    node = ast.parse(source.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {source!r}")
    name = node.func.id
    params = [p for p in signatures[name].parameters if p != "self"]
    arguments = {params[i]: ast.literal_eval(arg) for i, arg in enumerate(node.args)}
    arguments.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None})
    return ToolCall(name, arguments)


def _compact(value: Any, limit: int = _DETAIL_CHARS) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


def _summarise_check(outcome: dict[str, Any]) -> dict[str, Any]:
    """The checker's verdict, JSON-serialisable and short (its details hold whole backend states)."""
    summary: dict[str, Any] = {k: outcome[k] for k in ("error_type", "error_message") if k in outcome}
    details = outcome.get("details") or {}
    executed = outcome.get("execution_result", details.get("execution_result"))
    if isinstance(executed, list):
        summary["turn"] = len(executed) - 1
    elif match := re.search(r"turn (\d+)", outcome.get("error_message", "")):
        summary["turn"] = int(match.group(1))
    if "differences" in details:
        summary["differences"] = {
            attr: {side: _compact(v) for side, v in diff.items()} for attr, diff in details["differences"].items()
        }
    if "missing_items" in details:
        summary["missing_results"] = [_compact(v) for v in details["missing_items"]]
    return summary


# ---------------------------------------------------------------------------------------------------------------
# Episode


class BFCLEpisode:
    """One BFCL-v3 multi-turn task played turn by turn (see the module docstring)."""

    def __init__(
        self,
        task: Task,
        entry: dict[str, Any],
        ground_truth: list[list[str]],
        tools: dict[str, dict[str, Any]],
        held_out: dict[int, list[dict[str, Any]]],
        max_steps_per_turn: int = MAX_STEPS_PER_TURN,
        check_irrelevance: bool = False,
    ) -> None:
        self.task = task
        self._pkg = _package()
        self._entry = entry
        self._ground_truth = ground_truth
        self._initial_tools = list(tools.values())
        self._shown = set(tools)  # the functions documented to the model so far
        self._held_out = held_out  # turn index -> schemas revealed at that turn
        # Every backend method can be called, as in BFCL: a held-out function is only undocumented, and BFCL's
        # own ground truth sometimes calls one before the turn that reveals it.
        self._schemas = dict(tools) | {s["name"]: s for schemas in held_out.values() for s in schemas}
        self._max_steps = max_steps_per_turn
        self._check_irrelevance = check_irrelevance
        self._name = f"lopd_bfcl_{uuid.uuid4().hex}"  # BFCL's instance cache is keyed by model name
        self._checks_run = itertools.count()
        self._turn = 0
        self._steps_in_turn = 0
        self._executed: list[list[list[str]]] = [[]]  # per user turn, per step: the call strings executed
        self._trace: list[str] = [f"[turn 0] {_compact(task.instruction, 200)}"]
        self._n_calls = 0
        self._errors: dict[str, int] = {}
        self._done = False
        self.finish_reason = ""
        self._pkg.create_isolated(entry, self._name, eval_run=False)

    # -- protocol ----------------------------------------------------------------------------------------------

    def initial_messages(self) -> list[Message]:
        functions = _schemas_text(self._initial_tools)
        return [
            Message("system", SYSTEM_PROMPT.format(functions=functions)),
            Message("user", self._user_turn(0)),
        ]

    def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError(f"BFCL episode {self.task.task_id} is finished; step() after done")
        parsed = parse_action(action)
        if parsed.error is not None:
            self._count("parse_error")
            self._trace.append(f"parse error: {_compact(parsed.error, 120)}")
            return self._after_step([Message("tool", f"Error: {parsed.error}")], "parse_error", 0)
        if not parsed.calls:
            self._trace.append(f"answer: {_compact(parsed.text, 120)}")
            return self._end_user_turn()

        messages, executed, events = [], [], []
        for call in parsed.calls:
            problem = self._validate(call)
            if problem is not None:
                event, text = problem
                self._count(event)
                events.append(event)
                messages.append(Message("tool", f"Error: {text}"))
                self._trace.append(f"{event}: {format_call(call)}")
                continue
            source = _call_source(call)
            (result,) = self._pkg.execute([source], self._entry, self._name, eval_run=False)
            if result.startswith(_EXEC_ERROR_PREFIX):
                self._count("tool_error")
                events.append("tool_error")
            executed.append(source)
            messages.append(Message("tool", result))
            self._trace.append(format_call(call))
        if executed:
            self._executed[self._turn].append(executed)
        self._n_calls += len(executed)
        return self._after_step(messages, events[0] if events else "call", len(executed))

    def result(self) -> EpisodeResult:
        n_turns = len(self._ground_truth)
        complete = len(self._executed) == n_turns
        checks: list[dict[str, Any]] = [
            {"name": "turns_reached", "passed": complete, "detail": f"{len(self._executed)}/{n_turns}"}
        ]
        if complete:
            passed, detail = self._run_checker()
        else:  # BFCL fails an entry whose model stopped before the last turn ("force_terminated")
            passed, detail = False, {"error_type": "multi_turn:force_terminated", "turns": len(self._executed)}
        checks.append({"name": "bfcl_multi_turn", "passed": passed, "detail": detail})
        return EpisodeResult(
            reward=1.0 if passed else 0.0,
            checks=checks,
            trace="\n".join(self._trace),
            n_calls=self._n_calls,
            n_errors=sum(self._errors.values()),
            error_counts=dict(self._errors),
        )

    def close(self) -> None:
        """Release the backend instances; `result()` still works, `step()` no longer does."""
        if not self._done:
            self._finish("closed")
        self._pkg.release(self._name)

    # -- internals ---------------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._done

    def executed_calls(self) -> list[list[list[str]]]:
        """The BFCL call strings executed so far: per user turn, per step."""
        return copy.deepcopy(self._executed)

    def _user_turn(self, turn: int) -> str:
        text = _turn_text(self._entry["question"][turn])
        revealed = self._held_out.get(turn)
        if not revealed:
            return text
        functions = _schemas_text(revealed)
        reveal = REVEAL_PROMPT.format(functions=functions, sentence=self._pkg.reveal_sentence)
        return reveal + ("\n\n" + text if text else "")

    def _validate(self, call: ToolCall) -> tuple[str, str] | None:
        schema = self._schemas.get(call.name)
        if schema is None:
            return "unknown_tool", f"function {call.name!r} does not exist; available: {', '.join(sorted(self._shown))}"
        params = schema["parameters"].get("properties", {})
        bad = [k for k in call.arguments if not k.isidentifier() or keyword.iskeyword(k) or k not in params]
        if bad:
            return "bad_args", f"{call.name} has no parameter(s) {bad}; its parameters are {list(params)}"
        missing = [k for k in schema["parameters"].get("required", []) if k not in call.arguments]
        if missing:
            return "bad_args", f"{call.name} is missing required parameter(s) {missing}"
        return None

    def _after_step(self, messages: list[Message], event: str, n_calls: int) -> StepResult:
        self._steps_in_turn += 1
        if self._steps_in_turn >= self._max_steps:  # BFCL force-quits the whole entry
            self._trace.append(f"max steps ({self._max_steps}) in turn {self._turn}")
            self._finish("max_steps")
            return StepResult(messages, done=True, event="max_steps", n_calls=n_calls)
        return StepResult(messages, done=False, event=event, n_calls=n_calls)

    def _end_user_turn(self) -> StepResult:
        if self._turn + 1 >= len(self._ground_truth):
            self._finish("finish")
            return StepResult([], done=True, event="finish")
        self._turn += 1
        self._steps_in_turn = 0
        self._executed.append([])
        self._shown.update(schema["name"] for schema in self._held_out.get(self._turn, []))
        text = self._user_turn(self._turn)
        self._trace.append(f"[turn {self._turn}] {_compact(text, 200)}")
        return StepResult([Message("user", text)], done=False, event="no_call")

    def _finish(self, reason: str) -> None:
        self._done = True
        self.finish_reason = reason
        self._pkg.release(self._name)  # the checker re-executes the calls on its own instances

    def _count(self, event: str) -> None:
        self._errors[event] = self._errors.get(event, 0) + 1

    def _run_checker(self) -> tuple[bool, dict[str, Any]]:
        name = f"{self._name}_check{next(self._checks_run)}"
        decoded = [[step for step in turn if step] for turn in self._executed]
        try:
            self._pkg.create_isolated(self._entry, name, eval_run=True)
            self._pkg.create_isolated(self._entry, name + "_ground_truth", eval_run=True)
            outcome = self._pkg.checker.multi_turn_checker(
                decoded, self._ground_truth, self._entry, self._entry["id"].rsplit("_", 1)[0], name
            )
            if outcome["valid"] and self._check_irrelevance:
                outcome = self._pkg.checker.multi_turn_irrelevance_checker(decoded, self._ground_truth)
        except Exception as exc:  # the checker asserts on inconsistent inputs; a verdict, never a crash
            return False, {"error_type": "checker_error", "error_message": f"{type(exc).__name__}: {exc}"}
        finally:
            self._pkg.release(name)
        return bool(outcome["valid"]), _summarise_check(outcome)


# ---------------------------------------------------------------------------------------------------------------
# Suite


class BFCLSuite:
    """BFCL-v3 multi-turn tasks (all split "eval"); `subsets` picks which of the four to list."""

    name = SUITE_NAME

    def __init__(
        self,
        subsets: tuple[str, ...] | list[str] = SUBSETS,
        data_dir: str | Path | None = None,
        max_steps_per_turn: int = MAX_STEPS_PER_TURN,
        check_irrelevance: bool = False,
    ) -> None:
        for subset in subsets:
            _check_subset(subset)
        if max_steps_per_turn < 1:
            raise ValueError("max_steps_per_turn must be at least 1")
        self._pkg = _package()
        self.subsets = tuple(subsets)
        self.data_dir = str(Path(data_dir) if data_dir is not None else self._pkg.data_dir)
        self.max_steps_per_turn = max_steps_per_turn
        self.check_irrelevance = check_irrelevance
        self._tasks: dict[str, list[Task]] = {}

    def tasks(self, split: str, subset: str | None = None) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if subset is not None:
            _check_subset(subset)
        if split != "eval":  # BFCL is an evaluation benchmark: nothing may enter a training bank
            return []
        subsets = (subset,) if subset is not None else self.subsets
        return [task for s in subsets for task in self._subset_tasks(s)]

    def episode(self, task: Task) -> BFCLEpisode:
        entry, truth = self._lookup(task)
        tools = {schema["name"]: schema for schema in self._functions(entry)}
        held_out = {}
        for turn, names in entry.get("missed_function", {}).items():
            held_out[int(turn)] = [tools.pop(n) for n in names]
        return BFCLEpisode(
            task,
            entry,
            truth,
            tools,
            held_out,
            max_steps_per_turn=self.max_steps_per_turn,
            check_irrelevance=self.check_irrelevance,
        )

    def reference_calls(self, task: Task) -> list[list[ToolCall]]:
        """BFCL's ground truth for `task` as tool calls with keyword arguments, per user turn."""
        entry, truth = self._lookup(task)
        signatures: dict[str, inspect.Signature] = {}
        for class_name in entry["involved_classes"]:
            cls = self._pkg.backend_class(class_name)
            for method, fn in inspect.getmembers(cls, inspect.isfunction):
                if not method.startswith("_"):
                    signatures[method] = inspect.signature(fn)
        return [[_parse_call_source(src, signatures) for src in turn] for turn in truth]

    # -- internals ---------------------------------------------------------------------------------------------

    def _subset_tasks(self, subset: str) -> list[Task]:
        if subset not in self._tasks:
            loaded = _load_subset(self.data_dir, subset).values()
            self._tasks[subset] = [self._task(subset, entry, truth) for entry, truth in loaded]
        return self._tasks[subset]

    def _functions(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        docs: list[dict[str, Any]] = []
        for class_name in entry["involved_classes"]:
            docs.extend(copy.deepcopy(_func_docs(self.data_dir, self._pkg.func_doc_files[class_name])))
        return docs

    def _lookup(self, task: Task) -> tuple[dict[str, Any], list[list[str]]]:
        subset = task.metadata.get("subset") or _subset_of(task.task_id)
        try:
            return _load_subset(self.data_dir, subset)[task.task_id]
        except KeyError:
            raise KeyError(f"no BFCL-v3 task {task.task_id!r} in subset {subset!r}") from None

    def _task(self, subset: str, entry: dict[str, Any], truth: list[list[str]]) -> Task:
        missed = entry.get("missed_function", {})
        held_names = {n for names in missed.values() for n in names}
        tools = tuple(s for s in self._functions(entry) if s["name"] not in held_names)
        return Task(
            task_id=entry["id"],
            env_id=f"{SUITE_NAME}/{subset}",
            split="eval",
            instruction=_turn_text(entry["question"][0]),
            tools=tools,
            suite=SUITE_NAME,
            difficulty=sum(len(turn) for turn in truth),
            metadata={
                "subset": subset,
                "involved_classes": list(entry["involved_classes"]),
                "n_turns": len(entry["question"]),
                "user_turns": [_turn_text(turn) for turn in entry["question"]],
                "missed_function": {int(k): list(v) for k, v in missed.items()},
                "long_context": _is_long_context(entry["id"]),
            },
        )


def _check_subset(subset: str) -> None:
    if subset not in SUBSETS:
        raise ValueError(f"BFCL-v3 subset must be one of {SUBSETS}, got {subset!r}")


def _subset_of(task_id: str) -> str:
    return task_id.removeprefix("multi_turn_").rsplit("_", 1)[0]
