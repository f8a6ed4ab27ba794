"""The action format: how an assistant turn calls tools, shared by every suite.

An assistant turn either calls tools or answers. Tool calls are JSON objects `{"name": ..., "arguments": {...}}`,
one per call, optionally wrapped in `<tool_call>...</tool_call>` tags or given as a JSON list. A turn with no
tool call is a final answer (it ends the episode, or the user turn in multi-turn benchmarks).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


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


def _to_calls(value: Any) -> list[ToolCall] | str:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or "name" not in item:
            return f"a tool call must be an object with 'name' and 'arguments', got {json.dumps(item)[:200]}"
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                return f"arguments of {item['name']!r} are not valid JSON: {args[:200]}"
        if not isinstance(args, dict):
            return f"arguments of {item['name']!r} must be a JSON object"
        calls.append(ToolCall(str(item["name"]), args))
    return calls


def parse_action(text: str) -> ParsedAction:
    """Parse an assistant turn into tool calls, an answer, or a parse error."""
    tagged = _TAGGED.findall(text)
    if tagged:
        calls: list[ToolCall] = []
        for body in tagged:
            values, leftover = _json_values(body)
            if not values or leftover:
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
        if (isinstance(v, dict) and "name" in v) or (isinstance(v, list) and v and isinstance(v[0], dict)):
            parsed = _to_calls(v)
            if isinstance(parsed, str):
                return ParsedAction(error=parsed)
            calls.extend(parsed)
    if not calls and ("{" in text and '"name"' in text):
        return ParsedAction(error='could not parse the tool call; write {"name": ..., "arguments": {...}}')
    return ParsedAction(calls=calls, text=rest if calls else text.strip())


def format_call(call: ToolCall) -> str:
    return json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
