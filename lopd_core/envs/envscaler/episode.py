"""`EnvScalerEpisode`: one scenario played through text actions (tool calls run in a sandbox worker holding the
environment instance) and scored by the scenario's check functions in a second worker; see the package
docstring (`lopd_core.envs.envscaler`) for the protocol and the reward."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from lopd_core.conversation import Message
from lopd_core.envs.actions import TASK_SUFFIX, ToolCall, format_call, parse_action
from lopd_core.envs.base import EpisodeResult, StepResult, Task
from lopd_core.envs.envscaler.config import EnvScalerConfig
from lopd_core.envs.envscaler.prompts import system_prompt
from lopd_core.envs.envscaler.workers import WorkerPool, _Host
from lopd_core.envs.tools import validate_arguments
from lopd_core.sandbox import SandboxResult

ERROR_EVENTS = ("parse_error", "unknown_tool", "bad_args", "tool_error", "extra_calls")


class EnvScalerEpisode:
    """One scenario played through text actions; see the package docstring for the protocol."""

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
