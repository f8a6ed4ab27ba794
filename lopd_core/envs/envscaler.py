"""EnvScaler-format suites: environments as Python class source + tool schemas + rules, scenarios with checks.

The same loader reads the built-in `toolworld` suite (shipped data files) and real EnvScaler files:

* environment items (`191_env_metadata.json`): a JSON object keyed by env_id (or a list) of
  `{"env_id", "environment_introduction", "constraints_rules", "env_class_name", "env_class_code", "tools", ...}`;
  `tools` in the OpenAI layout, flat, or as a JSON string;
* scenario items (a JSON list): `{"env_id", "env_class_name", "task_id", "init_config", "task",
  "checklist_with_func": [{"check_item", "check_func"}], ...}`.

An episode follows EnvScaler's non-conversational environment: the initial observation is the task; each
assistant turn calls tools (observations come back as "tool" messages) or answers without a call, which
ends the episode. The reward is computed as EnvScaler does: every check function runs on the initial and
final state, reward = (number of checks returning True) / (number of checks), rounded to 4 places; a check
that raises, returns a non-bool, times out, crashes or tries a forbidden operation counts as failed.

Dataset code never runs in this process: each episode has one sandboxed worker holding the environment
instance and, at the end, a second fresh worker running the checks (`lopd_core.sandbox`). States travel
between them as plain data (JSON values, `lopd_core.sandbox_worker.encode`): a check reads a copy of the
state, never an object the environment's code could have rigged (an `__eq__` that always holds, say). Parse
errors, unknown tools, bad arguments, tool exceptions and tool timeouts become observations and are counted.

Starting a worker costs ~70 ms of CPU (a fresh interpreter that preloads the standard library), twice per
episode. For a suite whose code is trusted (the built-in toolworld suite: our own classes, checked against
their generator), `episodes_per_worker > 1` lets one worker host many episodes, each in its own slot of the
worker's namespace: the trainer stays isolated from the code, episodes are no longer isolated from each other.
Keep the default of 1 for files you did not write.

`prompt="compact"` shows the tools as signatures (`transfer(from_account_id, to_account_id, amount)`) without
descriptions, rules or examples, and the task without the call cue: ~50 tokens instead of ~500, for small
students that learn the format from demonstrations (the study testbed).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lopd_core.conversation import Message
from lopd_core.envs.actions import TASK_SUFFIX, ToolCall, format_call, parse_action, tool_call_instructions
from lopd_core.envs.base import SPLITS, EpisodeResult, StepResult, Task
from lopd_core.envs.tools import normalize_tools, validate_arguments
from lopd_core.sandbox import Sandbox, SandboxError, SandboxLimits, SandboxResult

ERROR_EVENTS = ("parse_error", "unknown_tool", "bad_args", "tool_error", "extra_calls")
PROMPT_STYLES = ("full", "compact", "minimal")


@dataclass(frozen=True)
class EnvScalerConfig:
    """Knobs of an EnvScaler-format suite."""

    limits: SandboxLimits = field(default_factory=lambda: SandboxLimits(timeout_s=10.0, memory_mb=1024, cpu_s=300))
    check_timeout_s: float = 5.0  # per check function
    max_calls_per_turn: int = 1  # further calls in the same turn are ignored (noted, counted as "extra_calls")
    max_observation_chars: int = 2000  # longer tool results are cut (the model sees a note)
    trace_result_chars: int = 80  # tool results in the compact trace are cut to this length
    include_rules: bool = True  # show the environment's rules in the system prompt
    call_style: str = "flat"  # how the prompt shows tool calls: "flat" {"tool": ...} or "nested" {"name", "arguments"}
    prompt: str = "full"  # "full": introduction, rules, call templates, examples; "compact": tool signatures only;
    # "minimal": the environment's id only (small students that learn the tools from demonstrations)
    episodes_per_worker: int = 1  # episodes one sandbox worker hosts (>1 only for trusted code; see the docstring)

    def __post_init__(self) -> None:
        if self.prompt not in PROMPT_STYLES:
            raise ValueError(f"EnvScalerConfig.prompt must be one of {PROMPT_STYLES}, got {self.prompt!r}")
        if self.episodes_per_worker < 1:
            raise ValueError(f"EnvScalerConfig.episodes_per_worker must be >= 1, got {self.episodes_per_worker}")


# The worker-side helpers (trusted code executed inside the sandbox). Environment instances live in `_lopd_envs`,
# one slot per episode. A class is loaded once per worker, as module lopd_env_<digest of its source>. States leave
# the worker as plain data (`_lopd_plain`: attributes that are not plain data become their `vars()` or repr),
# so the checks, in their own sandbox, read a JSON copy of the state and never an object the episode touched.
_ENV_HELPERS = r"""
import copy as _copy, hashlib as _hashlib, json as _json, sys as _sys, types as _types

_lopd_envs = {}
_lopd_modules = {}

def _lopd_load(code, class_name):
    key = _hashlib.sha256(code.encode()).hexdigest()[:16]
    module = _lopd_modules.get(key)
    if module is None:
        module = _types.ModuleType("lopd_env_" + key)
        _sys.modules[module.__name__] = module
        exec(compile(code, "<env_class_code>", "exec"), module.__dict__)
        _lopd_modules[key] = module
    if not hasattr(module, class_name):
        raise ValueError(f"class {class_name!r} not found in env_class_code")
    return getattr(module, class_name)

def _lopd_plain(value, depth=0):
    if depth > 100:
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_lopd_plain(v, depth + 1) for v in value]
        kind = list if isinstance(value, list) else tuple if isinstance(value, tuple) else type(value)
        try:
            return kind(items) if kind in (list, tuple) else (frozenset if isinstance(value, frozenset) else set)(items)
        except TypeError:
            return items
    if isinstance(value, dict):
        return {_lopd_plain(k, depth + 1): _lopd_plain(v, depth + 1) for k, v in value.items()}
    if hasattr(value, "__dict__"):
        return _lopd_plain(dict(vars(value)), depth + 1)
    return repr(value)

def _lopd_state(obj):
    state = {k: v for k, v in vars(obj).items() if not (k.startswith("__") and k.endswith("__"))}
    return _lopd_plain(state)

def _lopd_init(slot, code, class_name, init_config):
    cls = _lopd_load(code, class_name)
    config = _copy.deepcopy(init_config)
    try:
        env = cls(config if config and isinstance(config, dict) else {})
    except TypeError:
        env = cls()
    for key, value in (init_config or {}).items():
        setattr(env, key, _copy.deepcopy(value))
    _lopd_envs[slot] = env
    return _lopd_state(env)

def _lopd_restore(slot, code, class_name, state):
    cls = _lopd_load(code, class_name)
    env = cls.__new__(cls)
    for key, value in state.items():
        setattr(env, key, value)
    _lopd_envs[slot] = env
    return True

def _lopd_call(slot, name, arguments):
    env = _lopd_envs[slot]
    method = getattr(env, name, None) if not name.startswith("_") else None
    if not callable(method):
        raise AttributeError(f"the environment has no tool {name!r}")
    result = method(**arguments)
    try:
        text = _json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        text = str(result)
    return {"observation": str(text), "state": _lopd_state(env)}

def _lopd_drop(slot):
    _lopd_envs.pop(slot, None)
    return True

def _lopd_check(func_code, initial_state, final_state):
    namespace = {"__builtins__": __builtins__, "initial_state": initial_state}
    exec(compile(func_code, "<check_func>", "exec"), namespace)
    if "check_func" not in namespace:
        return {"result": None, "error": "function 'check_func' not found"}
    result = namespace["check_func"](final_state)
    if type(result) is not bool:
        return {"result": None, "error": f"check_func returned {type(result).__name__}, not bool"}
    return {"result": result, "error": None}
"""


# --------------------------------------------------------------------------------------------- loading


def _read_json(source: str | Path | Any) -> Any:
    if isinstance(source, (str, Path)):
        with open(source, encoding="utf-8") as fh:
            return json.load(fh)
    return source


def load_env_items(source: str | Path | dict[str, Any] | list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Environment items keyed by env_id, from a file (object keyed by env_id, or a list) or loaded JSON."""
    data = _read_json(source)
    items = data.items() if isinstance(data, dict) else ((item.get("env_id"), item) for item in data)
    out: dict[str, dict[str, Any]] = {}
    for key, item in items:
        if not isinstance(item, dict):
            raise ValueError(f"environment item {key!r} is not an object")
        env_id = str(item.get("env_id") or key)
        missing = [f for f in ("env_class_code", "tools") if f not in item]
        if missing:
            raise ValueError(f"environment {env_id!r} lacks {missing}")
        out[env_id] = {**item, "env_id": env_id, "tools": normalize_tools(item["tools"])}
    return out


def load_scenarios(source: str | Path | list[dict[str, Any]] | dict[str, Any]) -> list[dict[str, Any]]:
    """Scenario items from a file (a list, or an object whose values are items) or loaded JSON."""
    data = _read_json(source)
    items = list(data.values()) if isinstance(data, dict) else list(data)
    for i, item in enumerate(items):
        missing = [f for f in ("env_id", "task", "checklist_with_func") if f not in item]
        if missing:
            raise ValueError(f"scenario #{i} ({item.get('task_id', '?')}) lacks {missing}")
    return items


# ---------------------------------------------------------------------------------------------- prompts


def system_prompt(
    env_item: dict[str, Any],
    tools: Sequence[dict[str, Any]],
    include_rules: bool = True,
    call_style: str = "flat",
    prompt: str = "full",
) -> str:
    """The system message: what the environment is, its rules, the tools and the action format."""
    if prompt == "compact":
        return compact_system_prompt(tools)
    if prompt == "minimal":  # the environment's name only: its tools are learnt from demonstrations
        return f"Environment: {env_item.get('env_id', '')}"
    parts = [str(env_item.get("environment_introduction") or env_item.get("environment_summary") or "").strip()]
    rules = env_item.get("constraints_rules") or []
    if include_rules and rules:
        parts.append("Rules:\n" + "\n".join(f"- {rule}" for rule in rules))
    parts.append(tool_call_instructions(tools, call_style, env_item.get("usage_examples") or ()))
    return "\n\n".join(p for p in parts if p)


def compact_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """Tools as signatures, optional parameters marked `?`: `Tools: get_balance(account_id) list_bills(payee?)`."""
    signatures = []
    for tool in tools:
        params = tool.get("parameters") or {}
        required = set(params.get("required") or [])
        names = [k if k in required else f"{k}?" for k in params.get("properties") or {}]
        signatures.append(f"{tool['name']}({', '.join(names)})")
    return "Tools: " + " ".join(signatures)


# ---------------------------------------------------------------------------------------------- workers


@dataclass
class _Host:
    """A sandbox worker and the episodes it hosts (`users` now, `hosted` over its life)."""

    box: Sandbox
    hosted: int = 0
    users: int = 0
    retired: bool = False
    helpers_pid: int | None = None  # the worker process that has the helpers loaded


class WorkerPool:
    """Sandbox workers handed to episodes: a fresh one per episode (`per_worker=1`), or one shared by up to
    `per_worker` episodes over its life, then replaced (closed once its last episode has let go)."""

    def __init__(self, limits: SandboxLimits, per_worker: int = 1) -> None:
        self.limits = limits
        self.per_worker = per_worker
        self._current: _Host | None = None

    def acquire(self) -> _Host:
        host = self._current
        if host is None or host.hosted >= self.per_worker:
            if host is not None:
                host.retired = True
                self._close_if_idle(host)
            host = self._current = _Host(Sandbox(self.limits))
            host.box.spawn()  # it comes up while the model writes its first turn
        host.hosted += 1
        host.users += 1
        return host

    def release(self, host: _Host) -> None:
        host.users -= 1
        if host.retired or self.per_worker == 1:
            host.retired = True
            self._close_if_idle(host)

    def ready(self, host: _Host) -> int | None:
        """Start the worker if needed and load the helpers once per worker process; its pid, None on failure."""
        try:
            pid = host.box.start().pid
        except SandboxError:
            return None
        if host.helpers_pid != pid:
            setup = host.box.exec(_ENV_HELPERS, filename="<lopd-env-helpers>")
            if not setup.ok:
                return None
            host.helpers_pid = pid
        return pid

    def _close_if_idle(self, host: _Host) -> None:
        if host.users <= 0:
            host.box.close()
            if self._current is host:
                self._current = None

    def close(self) -> None:
        if self._current is not None:
            self._current.box.close()
            self._current = None


# ---------------------------------------------------------------------------------------------- episode


class EnvScalerEpisode:
    """One scenario played through text actions; see the module docstring for the protocol."""

    def __init__(
        self,
        task: Task,
        scenario: dict[str, Any],
        env_item: dict[str, Any],
        config: EnvScalerConfig,
        pools: tuple[WorkerPool, WorkerPool] | None = None,
    ) -> None:
        self.task = task
        self.scenario = scenario
        self.env_item = env_item
        self.config = config
        self.tools = {t["name"]: t for t in task.tools}
        self._class_name = str(scenario.get("env_class_name") or env_item.get("env_class_name") or "")
        if pools is None:
            check_limits = replace(config.limits, timeout_s=config.check_timeout_s)
            pools = (WorkerPool(config.limits), WorkerPool(check_limits))
        self._env_pool, self._check_pool = pools
        self._slot = f"{task.task_id}#{next(_SLOTS)}"
        self._env: _Host | None = None
        self._env_pid: int | None = None  # the worker process holding this episode's environment instance
        self._checker: _Host | None = None
        self._init_state: dict[str, Any] | None = None  # plain data (a JSON copy), never a live object
        self._state: dict[str, Any] | None = None
        self._env_error: str | None = None
        self._trace: list[str] = []
        self._error_counts = {e: 0 for e in ERROR_EVENTS}
        self._n_calls = 0
        self._done = False
        self._result: EpisodeResult | None = None

    # --------------------------------------------------------------------------------- environment

    def _start_env(self) -> bool:
        """Make sure a worker holds this episode's environment instance; False if the environment cannot run."""
        if self._env_error is not None:
            return False  # a permanent failure: the environment cannot be built
        self._env = self._env or self._env_pool.acquire()
        pid = self._env_pool.ready(self._env)
        if pid is None:
            self._env_error = "sandbox setup failed"
            return False
        if self._env_pid == pid:
            return True
        box, code = self._env.box, self.env_item["env_class_code"]
        if self._state is None:
            init_config = self.scenario.get("init_config") or {}
            built = box.call("_lopd_init", self._slot, code, self._class_name, init_config, codec=True)
            if not built.ok or built.violations:
                self._env_error = f"environment failed to initialise: {built.error or built.violations}"
                return False
            if not isinstance(built.value, dict):
                self._env_error = "environment state is not a mapping"
                return False
            self._init_state = self._state = built.value
        else:  # the worker died (timeout/crash): rebuild the instance from the last state snapshot
            restored = box.call("_lopd_restore", self._slot, code, self._class_name, self._state, codec=True)
            if not restored.ok:
                self._env_error = f"environment could not be restored: {restored.error}"
                return False
        self._env_pid = pid
        return True

    def _execute(self, call: ToolCall) -> tuple[str, str]:
        """Run one tool call; returns (observation text, event)."""
        tool = self.tools.get(call.name)
        if tool is None:
            names = ", ".join(self.tools)
            return f"Error: unknown tool {call.name!r}. Available tools: {names}.", "unknown_tool"
        arguments, problem = validate_arguments(tool, call.arguments)
        if problem:
            return f"Error: {problem}.", "bad_args"
        if not self._start_env():
            return f"Error: the environment is unavailable ({self._env_error}).", "tool_error"
        assert self._env is not None
        result: SandboxResult = self._env.box.call("_lopd_call", self._slot, call.name, arguments, codec=True)
        if result.ok and not result.violations and _is_step(result.value):
            self._state = result.value["state"]
            return self._cut(result.value["observation"]), "call"
        if result.ok and not result.violations:
            return "Error: the tool call returned a malformed result.", "tool_error"
        if result.ok:  # the tool did something forbidden and then returned normally
            return f"Error: the tool attempted a forbidden operation ({'; '.join(result.violations)}).", "tool_error"
        if result.error_type in ("timeout", "crash", "too_large"):
            self._env.box.close()  # restarted (every hosted episode from its last state) on the next call
            self._env_pid = None
            return f"Error: the tool call failed ({result.error}).", "tool_error"
        return f"Error: {result.error}", "tool_error"

    def _cut(self, text: str) -> str:
        limit = self.config.max_observation_chars
        return text if len(text) <= limit else text[:limit] + f" ... [cut, {len(text) - limit} more characters]"

    # -------------------------------------------------------------------------------------- protocol

    def initial_messages(self) -> list[Message]:
        # Take the workers now: new ones come up while the model writes its first turn.
        self._env = self._env or self._env_pool.acquire()
        self._checker = self._checker or self._check_pool.acquire()
        cfg = self.config
        prompt = system_prompt(self.env_item, self.task.tools, cfg.include_rules, cfg.call_style, cfg.prompt)
        short = cfg.prompt in ("compact", "minimal")
        task = self.task.instruction if short else f"{self.task.instruction}\n{TASK_SUFFIX}"
        return [Message("system", prompt), Message("user", task)]

    def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError(f"episode {self.task.task_id} is already finished")
        parsed = parse_action(action)
        if parsed.error is not None:
            self._error_counts["parse_error"] += 1
            self._trace.append("parse error")
            hint = "Write one JSON tool call as shown in the tool list, or answer without JSON when done."
            return StepResult([Message("tool", f"Error: {parsed.error}. {hint}")], done=False, event="parse_error")
        if not parsed.calls:
            self._done = True
            self._trace.append(f"answer: {_short(parsed.text, self.config.trace_result_chars)}")
            return StepResult([], done=True, event="finish")
        messages, events = [], []
        limit = self.config.max_calls_per_turn
        for call in parsed.calls[:limit]:
            self._n_calls += 1
            observation, event = self._execute(call)
            if event != "call":
                self._error_counts[event] += 1
            messages.append(Message("tool", observation))
            events.append(event)
            short = "error" if event != "call" else _short(observation, self.config.trace_result_chars)
            self._trace.append(f"{format_call(call)} -> {short}")
        ignored = len(parsed.calls) - limit
        if ignored > 0:  # EnvScaler runs one action per step: further calls in the turn do not run
            self._error_counts["extra_calls"] += 1
            note = f"(Only {limit} tool call per turn runs; {ignored} more in your reply were ignored.)"
            last = messages[-1]
            messages[-1] = Message("tool", f"{last.content}\n{note}")
            events.append("extra_calls")
        event = next((e for e in events if e != "call"), "call")
        return StepResult(messages, done=False, event=event, n_calls=min(len(parsed.calls), limit))

    def result(self) -> EpisodeResult:
        """Score the final state (runs the checks once; later calls return the same result)."""
        if self._result is not None:
            return self._result
        self._done = True
        checks = self._run_checks()
        passed = sum(1 for c in checks if c["passed"])
        reward = round(passed / len(checks), 4) if checks else 0.0
        n_errors = sum(self._error_counts.values())
        self._result = EpisodeResult(
            reward=reward,
            checks=checks,
            trace="\n".join(self._trace),
            n_calls=self._n_calls,
            n_errors=n_errors,
            error_counts=dict(self._error_counts),
        )
        self.close()
        return self._result

    def _run_checks(self) -> list[dict[str, Any]]:
        items = self.scenario.get("checklist_with_func") or []
        if self._init_state is None:
            self._start_env()
        if self._init_state is None or self._state is None:
            detail = self._env_error or "the environment could not be built"
            return [{"name": _check_name(it, i), "passed": False, "detail": detail} for i, it in enumerate(items)]
        out = []
        host = self._checker = self._checker or self._check_pool.acquire()
        loaded_pid = None
        for i, item in enumerate(items):
            pid = self._check_pool.ready(host)  # a fresh or restarted worker: helpers, then the class
            ready = SandboxResult(ok=pid is not None, error="the checker worker could not start")
            if pid is not None and pid != loaded_pid:
                ready = host.box.call("_lopd_load", self.env_item["env_class_code"], self._class_name)
                loaded_pid = pid if ready.ok else None
            if not ready.ok:
                detail = f"checker setup failed: {ready.error}"
                out += [
                    {"name": _check_name(it, j), "passed": False, "detail": detail} for j, it in enumerate(items[i:], i)
                ]
                break
            res = host.box.call("_lopd_check", item.get("check_func", ""), self._init_state, self._state, codec=True)
            if res.ok and not isinstance(res.value, dict):
                res = SandboxResult(ok=False, error_type="exception", error="the check returned a malformed result")
            if not res.ok:
                detail = f"{res.error_type}: {res.error}"
            elif res.violations:
                detail = "sandbox violation: " + "; ".join(res.violations)
            else:
                detail = res.value.get("error") or ""
            passed = res.ok and not res.violations and res.value.get("result") is True
            out.append({"name": _check_name(item, i), "passed": bool(passed), "detail": detail})
        return out

    def close(self) -> None:
        """Give the workers back (a fresh worker per episode is closed; a shared one drops this episode's slot)."""
        if self._env is not None:
            if self._env_pid is not None and self._env_pool.per_worker > 1 and self._env.box.alive:
                self._env.box.call("_lopd_drop", self._slot)
            self._env_pool.release(self._env)
        if self._checker is not None:
            self._check_pool.release(self._checker)
        self._env = self._checker = None
        self._env_pid = None


_SLOTS = itertools.count()


def _is_step(value: Any) -> bool:
    """A tool call's result as the helpers build it (the environment's code could return anything)."""
    return (
        isinstance(value, dict) and isinstance(value.get("state"), dict) and isinstance(value.get("observation"), str)
    )


def _short(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _check_name(item: dict[str, Any], i: int) -> str:
    return str(item.get("check_item") or f"check {i + 1}")


# ------------------------------------------------------------------------------------------------ suite


class EnvScalerSuite:
    """Tasks per split from EnvScaler-format environment and scenario items; episodes run sandboxed."""

    def __init__(
        self,
        env_items: dict[str, dict[str, Any]],
        scenarios: dict[str, Iterable[dict[str, Any]]],
        name: str = "envscaler",
        config: EnvScalerConfig | None = None,
    ) -> None:
        self.name = name
        self.config = config or EnvScalerConfig()
        self.env_items = env_items
        self._scenarios: dict[str, dict[str, Any]] = {}
        self._tasks: dict[str, list[Task]] = {s: [] for s in SPLITS}
        self.skipped: list[str] = []  # scenarios left out (unknown environment or no checks), with the reason
        check_limits = replace(self.config.limits, timeout_s=self.config.check_timeout_s)
        per_worker = self.config.episodes_per_worker
        self._pools = (WorkerPool(self.config.limits, per_worker), WorkerPool(check_limits, per_worker))
        for split, items in scenarios.items():
            if split not in SPLITS:
                raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
            for index, item in enumerate(items):
                self._add(split, index, item)

    def _add(self, split: str, index: int, item: dict[str, Any]) -> None:
        env_id = str(item["env_id"])
        task_id = str(item.get("task_id") or f"{env_id}-{index}")
        if env_id not in self.env_items:
            self.skipped.append(f"{task_id}: unknown environment {env_id!r}")
            return
        if not item.get("checklist_with_func"):
            self.skipped.append(f"{task_id}: no checks")
            return
        if task_id in self._scenarios:
            raise ValueError(f"duplicate task_id {task_id!r} (task ids must be unique across splits)")
        self._scenarios[task_id] = item
        difficulty = item.get("difficulty")
        self._tasks[split].append(
            Task(
                task_id=task_id,
                env_id=env_id,
                split=split,
                instruction=str(item["task"]),
                tools=tuple(self.env_items[env_id]["tools"]),
                suite=self.name,
                difficulty=int(difficulty) if difficulty is not None else None,
                metadata={"n_checks": len(item["checklist_with_func"])},
            )
        )

    @classmethod
    def from_files(
        cls,
        env_metadata: str | Path,
        scenarios: dict[str, str | Path | Sequence[str | Path]],
        name: str = "envscaler",
        config: EnvScalerConfig | None = None,
    ) -> EnvScalerSuite:
        """`scenarios` maps a split to one scenario file or several."""
        loaded: dict[str, list[dict[str, Any]]] = {}
        for split, paths in scenarios.items():
            paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
            loaded[split] = [item for p in paths for item in load_scenarios(p)]
        return cls(load_env_items(env_metadata), loaded, name=name, config=config)

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        return list(self._tasks[split])

    def task(self, task_id: str) -> Task:
        for tasks in self._tasks.values():
            for task in tasks:
                if task.task_id == task_id:
                    return task
        raise KeyError(task_id)

    def scenario(self, task_id: str) -> dict[str, Any]:
        """The raw scenario item (it may hold a reference solution: never show it to the policy)."""
        return self._scenarios[task_id]

    def episode(self, task: Task) -> EnvScalerEpisode:
        scenario = self._scenarios[task.task_id]
        return EnvScalerEpisode(task, scenario, self.env_items[task.env_id], self.config, self._pools)

    def close(self) -> None:
        """Stop the shared workers (episodes still open get fresh ones)."""
        for pool in self._pools:
            pool.close()


def split_scenarios(
    items: Sequence[dict[str, Any]], n_eval: int = 200, seed: int = 0
) -> dict[str, list[dict[str, Any]]]:
    """Split one scenario list into train/eval by a seeded shuffle (for users with a single EnvScaler file)."""
    import random

    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    eval_ids = set(order[:n_eval])
    return {
        "train": [it for i, it in enumerate(items) if i not in eval_ids],
        "eval": [it for i, it in enumerate(items) if i in eval_ids],
    }
