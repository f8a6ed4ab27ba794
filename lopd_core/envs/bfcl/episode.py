"""`BFCLEpisode`: one BFCL-v3 multi-turn task played turn by turn, the calls executed on the package's backend
classes and the result checked by its `multi_turn_checker`; the system prompt and the reveal of held-out functions.
See the package docstring (`lopd_core.envs.bfcl`) for the protocol."""

from __future__ import annotations

import copy
import itertools
import keyword
import uuid
from typing import Any

from lopd_core.conversation import Message
from lopd_core.envs.actions import ToolCall, format_call, parse_action
from lopd_core.envs.base import EpisodeResult, StepResult, Task
from lopd_core.envs.bfcl.calls import _call_source, _compact, _summarise_check
from lopd_core.envs.bfcl.data import _schemas_text, _turn_text
from lopd_core.envs.bfcl.package import _package

MAX_STEPS_PER_TURN = 20  # BFCL's MAXIMUM_STEP_LIMIT
_EXEC_ERROR_PREFIX = "Error during execution:"

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


class BFCLEpisode:
    """One BFCL-v3 multi-turn task played turn by turn (see the package docstring)."""

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
