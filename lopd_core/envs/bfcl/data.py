"""BFCL-v3 multi-turn data files: a subset's test entries with their per-turn ground truth, one backend class's
function docs as JSON schemas, and the text of a user turn."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

# BFCL's function docs use Python-ish type names; the system prompt shows JSON schema types.
_JSON_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string", "bool": "boolean"}


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
