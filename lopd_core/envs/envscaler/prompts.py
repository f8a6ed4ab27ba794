"""The system message of an EnvScaler episode: the environment, its rules, the tools and the action format
("full"), the tools as signatures ("compact"), or the environment's id alone ("minimal")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lopd_core.envs.actions import tool_call_instructions


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
