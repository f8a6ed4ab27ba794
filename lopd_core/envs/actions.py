"""The action format: how an assistant turn calls tools, shared by every suite.

An assistant turn either calls tools or answers. A tool call is one JSON object, in either of two forms:

* nested: `{"name": "transfer", "arguments": {"amount": 5}}` (also `"parameters"` for `"arguments"`);
* flat:   `{"tool": "transfer", "amount": 5}`: every key but "tool" is an argument (the form the toolworld
  prompts teach: a 135M-parameter model writes it far more reliably than the nested one).

Calls may be wrapped in `<tool_call>...</tool_call>` tags, given as a JSON list, or surrounded by text or a
code fence (the JSON objects are found in the text). A turn with no tool call is a final answer (it ends the
episode, or the user turn in multi-turn benchmarks). A turn that looks like a call but cannot be read is a
parse error, which the model sees as an observation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

CALL_STYLES = ("flat", "nested")


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedAction:
    calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None  # a parse error the model should see as an observation
    text: str = ""  # the text outside tool calls (the answer when there are no calls)

    @property
    def is_answer(self) -> bool:
        return not self.calls and self.error is None


def _json_values(text: str) -> tuple[list[Any], str]:
    """Decode every top-level JSON object/list in `text`; return them and the remaining text."""
    decoder = json.JSONDecoder()
    values, rest, i = [], [], 0
    while i < len(text):
        if text[i] in "{[":
            try:
                value, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                rest.append(text[i])
                i += 1
                continue
            values.append(value)
            i = end
        else:
            rest.append(text[i])
            i += 1
    return values, "".join(rest).strip()


def _is_call(value: Any) -> bool:
    if isinstance(value, dict):
        return "name" in value or "tool" in value
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _one_call(item: Any) -> ToolCall | str:
    if not isinstance(item, dict) or not ("name" in item or "tool" in item):
        return f"a tool call must be a JSON object with a 'tool' (or 'name') key, got {json.dumps(item)[:200]}"
    if "tool" not in item:
        name, args = item["name"], item.get("arguments", item.get("parameters", {}))
    else:  # flat (a "name" key is then an argument) or {"tool": ..., "arguments": {...}}
        name = item["tool"]
        rest = {k: v for k, v in item.items() if k != "tool"}
        nested = set(rest) == {"arguments"} and isinstance(rest["arguments"], dict)
        args = rest["arguments"] if nested else rest
    if not isinstance(name, str) or not name:
        return f"the tool name must be a non-empty string, got {json.dumps(name)[:100]}"
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return f"arguments of {name!r} are not valid JSON: {args[:200]}"
    if not isinstance(args, dict):
        return f"arguments of {name!r} must be a JSON object"
    return ToolCall(name, args)


def _to_calls(value: Any) -> list[ToolCall] | str:
    calls = []
    for item in value if isinstance(value, list) else [value]:
        call = _one_call(item)
        if isinstance(call, str):
            return call
        calls.append(call)
    return calls


def parse_action(text: str) -> ParsedAction:
    """Parse an assistant turn into tool calls, an answer, or a parse error."""
    tagged = _TAGGED.findall(text)
    if tagged:
        calls: list[ToolCall] = []
        for body in tagged:
            values, leftover = _json_values(body)
            if not values or leftover.strip("`").strip():
                return ParsedAction(error=f"could not parse the tool call as JSON: {body[:200]!r}")
            for v in values:
                parsed = _to_calls(v)
                if isinstance(parsed, str):
                    return ParsedAction(error=parsed)
                calls.extend(parsed)
        return ParsedAction(calls=calls, text=_TAGGED.sub("", text).strip())
    values, rest = _json_values(text)
    calls = []
    for v in values:
        if _is_call(v):
            parsed = _to_calls(v)
            if isinstance(parsed, str):
                return ParsedAction(error=parsed)
            calls.extend(parsed)
    if not calls and "{" in text and re.search(r'"(name|tool)"\s*:', text):
        return ParsedAction(error="could not parse the tool call; it must be one valid JSON object")
    return ParsedAction(calls=calls, text=rest if calls else text.strip())


def format_call(call: ToolCall, style: str = "nested") -> str:
    """A call as JSON text: nested `{"name", "arguments"}` (the trace format) or flat `{"tool", ...}`."""
    if style == "flat" and "tool" not in call.arguments:
        return json.dumps({"tool": call.name, **call.arguments}, ensure_ascii=False)
    return json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)


def call_template(tool: dict[str, Any], style: str = "flat") -> str:
    """A tool as the exact call to write, with example values: {"tool": "t", "a": "ACC-1042"}."""
    from lopd_core.envs.tools import example_value

    props = (tool.get("parameters") or {}).get("properties") or {}
    return format_call(ToolCall(tool["name"], {k: example_value(v) for k, v in props.items()}), style)


CALL_FORMAT_HINT = (
    "To use a tool, reply with one JSON object like the ones above, with the values filled in, and nothing else."
)
# Appended to the task in the first user message: a cue that measurably raises small models' call rate.
TASK_SUFFIX = "Reply with one JSON object."


def tool_call_instructions(
    tools: Sequence[dict[str, Any]], style: str = "flat", examples: Sequence[dict[str, Any]] = ()
) -> str:
    """The action-format part of a system prompt: every tool as a call template with example values and its
    description, worked examples if given (`{"task", "call": {"name", "arguments"}, "result"}`; the first one
    shows a whole exchange), then how to call a tool and how to finish.

    Kept short and example-led on purpose: a 135M-parameter model follows "User: ... / Assistant: {...}" pairs
    far better than prose (measured by the log-probability of correct first calls; see docs/environments.md)."""
    if style not in CALL_STYLES:
        raise ValueError(f"style must be one of {CALL_STYLES}")
    lines = [f"{call_template(tool, style)}  # {tool.get('description', '')}".rstrip(" #") for tool in tools]
    text = "Tools:\n" + "\n".join(lines)
    if examples:
        rows = []
        for i, example in enumerate(examples):
            call = ToolCall(example["call"]["name"], dict(example["call"].get("arguments") or {}))
            row = f"User: {example['task']}\nAssistant: {format_call(call, style)}"
            if i == 0 and example.get("result"):
                row += f"\nTool: {example['result']}\nAssistant: Done."
            rows.append(row)
        text += "\n\nExamples:\n" + "\n".join(rows)
    return text + f"\n\n{CALL_FORMAT_HINT} When the task is done, reply with a short sentence without JSON."
