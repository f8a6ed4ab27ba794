"""Tool schemas: normalising the formats suites ship, checking call arguments, deriving schemas from Python methods.

A tool schema is `{"name", "description", "parameters"}` with JSON-Schema `parameters` (`type: object`,
`properties`, `required`). Suites ship it in the OpenAI layout (`{"type": "function", "function": {...}}`,
EnvScaler), flat, or as a JSON string; `normalize_tool` accepts all three.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from typing import Any

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}
_PY_TO_JSON = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def normalize_tool(tool: dict[str, Any] | str) -> dict[str, Any]:
    """The flat schema `{"name", "description", "parameters"}` of a tool given in any supported layout."""
    if isinstance(tool, str):
        tool = json.loads(tool)
    if not isinstance(tool, dict):
        raise ValueError(f"a tool schema must be an object, got {type(tool).__name__}")
    if "function" in tool and isinstance(tool["function"], dict):
        tool = tool["function"]
    if "name" not in tool:
        raise ValueError(f"a tool schema needs a name: {json.dumps(tool)[:200]}")
    params = tool.get("parameters") or {"type": "object", "properties": {}}
    params = {"type": "object", "properties": {}, **params}
    return {"name": str(tool["name"]), "description": str(tool.get("description", "")).strip(), "parameters": params}


def normalize_tools(tools: Any) -> list[dict[str, Any]]:
    if isinstance(tools, str):
        tools = json.loads(tools)
    return [normalize_tool(t) for t in tools or []]


def _matches(value: Any, json_type: str | list[str] | None) -> bool:
    if json_type is None:
        return True
    types = json_type if isinstance(json_type, list) else [json_type]
    for t in types:
        allowed = JSON_TYPES.get(t)
        if allowed is None:
            return True  # an unknown type name: do not second-guess the suite
        if isinstance(value, bool) and t in ("integer", "number"):
            continue
        if isinstance(value, allowed):
            return True
    return False


def _coerce(value: Any, json_type: Any) -> Any:
    """Lenient conversions a small model needs: "12" -> 12 for integer/number, 12 -> 12.0 is left alone."""
    if isinstance(value, str) and json_type in ("integer", "number"):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            return value
        if json_type == "integer" and number.is_integer():
            return int(number)
        return number if json_type == "number" else value
    if isinstance(value, float) and json_type == "integer" and value.is_integer():
        return int(value)
    if isinstance(value, str) and json_type == "boolean" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return value


def validate_arguments(tool: dict[str, Any], arguments: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Check `arguments` against the tool's parameter schema. Returns (possibly coerced arguments, error or None).

    Checked: required parameters present, no unknown parameter names, JSON types and enums of top-level
    parameters. Numeric strings are accepted for numeric parameters.
    """
    params = tool.get("parameters") or {}
    props: dict[str, Any] = params.get("properties") or {}
    required = list(params.get("required") or [])
    name = tool.get("name", "?")
    unknown = [k for k in arguments if props and k not in props]
    if unknown:
        expected = ", ".join(props) or "none"
        return arguments, f"{name}: unknown argument(s) {', '.join(map(repr, unknown))}; expected: {expected}"
    missing = [k for k in required if k not in arguments]
    if missing:
        return arguments, f"{name}: missing required argument(s) {', '.join(map(repr, missing))}"
    out = {}
    for key, value in arguments.items():
        spec = props.get(key) or {}
        json_type = spec.get("type")
        value = _coerce(value, json_type)
        if not _matches(value, json_type):
            return arguments, f"{name}: argument {key!r} must be of type {json_type}, got {json.dumps(value)[:60]}"
        if "enum" in spec and value not in spec["enum"]:
            return arguments, f"{name}: argument {key!r} must be one of {spec['enum']}"
        out[key] = value
    return out, None


_EXAMPLE = re.compile(r"""(?:for example|e\.g\.),?\s*(?:"([^"]+)"|'([^']+)'|(-?\d+(?:\.\d+)?))""", re.IGNORECASE)


def example_value(spec: dict[str, Any]) -> Any:
    """A value of the parameter's type for call templates shown to the model: the schema's first `examples`
    entry, else an example quoted in its description ('for example "ACC-1042"'), else a typed placeholder."""
    json_type = spec.get("type")
    if spec.get("examples"):
        return spec["examples"][0]
    if spec.get("enum"):
        return spec["enum"][0]
    match = _EXAMPLE.search(str(spec.get("description", "")))
    if match:
        text = next(g for g in match.groups() if g is not None)
        if json_type in ("integer", "number"):
            try:
                return int(text) if json_type == "integer" or "." not in text else float(text)
            except ValueError:
                pass
        elif json_type in (None, "string"):
            return text
    return {"integer": 0, "number": 0, "boolean": False, "array": [], "object": {}}.get(json_type, "...")


# --------------------------------------------------------------------------- schemas from Python methods


_ARGS_LINE = re.compile(r"^\s{4,}(\w+)(?:\s*\([^)]*\))?:\s*(.+)$")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {argument: description})."""
    lines = inspect.cleandoc(doc or "").splitlines()
    description: list[str] = []
    args: dict[str, str] = {}
    section = "description"
    current = None
    for line in lines:
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            section = "args"
            continue
        if stripped.endswith(":") and stripped[:-1] in ("Returns", "Raises", "Notes", "Examples"):
            section = "other"
            continue
        if section == "description" and stripped:
            description.append(stripped)
        elif section == "args":
            match = _ARGS_LINE.match("    " + line) if not line.startswith(" ") else _ARGS_LINE.match(line)
            if match:
                current = match.group(1)
                args[current] = match.group(2).strip()
            elif stripped and current:
                args[current] += " " + stripped
    return " ".join(description), args


def schema_from_method(method: Callable[..., Any]) -> dict[str, Any]:
    """The flat tool schema of a method: name, docstring description, typed parameters (defaults are optional)."""
    description, arg_docs = _docstring_parts(method.__doc__ or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(method).parameters.items():
        if name == "self":
            continue
        spec: dict[str, Any] = {}
        annotation = param.annotation
        if isinstance(annotation, str):
            annotation = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}.get(
                annotation, annotation
            )
        if annotation in _PY_TO_JSON:
            spec["type"] = _PY_TO_JSON[annotation]
        if name in arg_docs:
            spec["description"] = arg_docs[name]
        if param.default is inspect.Parameter.empty:
            required.append(name)
        else:
            spec["default"] = param.default
        properties[name] = spec
    return {
        "name": method.__name__,
        "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required},
    }


def tools_of_class(cls: type) -> list[dict[str, Any]]:
    """Schemas of a class's public methods, in definition order."""
    return [
        schema_from_method(member)
        for name, member in vars(cls).items()
        if callable(member) and not name.startswith("_")
    ]
