"""Calls: JSON actions as BFCL call strings, BFCL's ground-truth call strings back as tool calls, and the checker's
verdict summarised (short, JSON-serialisable)."""

from __future__ import annotations

import ast
import inspect
import re
from typing import Any

from lopd_core.envs.actions import ToolCall

_DETAIL_CHARS = 400


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
