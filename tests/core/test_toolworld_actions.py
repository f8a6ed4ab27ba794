"""The action format: flat and nested JSON calls, tags, lists, fences, answers, parse errors; tool schemas."""

from __future__ import annotations

import json

import pytest

from lopd_core.envs.actions import (
    ToolCall,
    call_template,
    format_call,
    parse_action,
    tool_call_instructions,
)
from lopd_core.envs.tools import example_value, normalize_tool, schema_from_method, validate_arguments


@pytest.mark.parametrize(
    "text",
    [
        '{"tool": "transfer", "from_account_id": "ACC-1", "amount": 5}',
        '{"name": "transfer", "arguments": {"from_account_id": "ACC-1", "amount": 5}}',
        '{"name": "transfer", "parameters": {"from_account_id": "ACC-1", "amount": 5}}',
        '{"name": "transfer", "arguments": "{\\"from_account_id\\": \\"ACC-1\\", \\"amount\\": 5}"}',
        '{"tool": "transfer", "arguments": {"from_account_id": "ACC-1", "amount": 5}}',
        '<tool_call>{"name": "transfer", "arguments": {"from_account_id": "ACC-1", "amount": 5}}</tool_call>',
        'Here is the call:\n```json\n{\n  "tool": "transfer",\n  "from_account_id": "ACC-1",\n  "amount": 5\n}\n```',
    ],
)
def test_every_call_form_gives_the_same_call(text):
    parsed = parse_action(text)
    assert parsed.error is None and not parsed.is_answer
    assert parsed.calls == [ToolCall("transfer", {"from_account_id": "ACC-1", "amount": 5})]


def test_several_calls_answers_and_errors():
    two = parse_action('[{"tool": "a", "x": 1}, {"name": "b", "arguments": {}}]')
    assert [c.name for c in two.calls] == ["a", "b"] and two.calls[0].arguments == {"x": 1}
    tagged = parse_action('<tool_call>{"tool": "a"}</tool_call> then <tool_call>{"tool": "b", "y": 2}</tool_call>')
    assert [(c.name, c.arguments) for c in tagged.calls] == [("a", {}), ("b", {"y": 2})]
    assert tagged.text == "then"
    named = parse_action('{"tool": "add_contact", "name": "Zoe Park", "phone": "555-0101"}')
    assert named.calls == [ToolCall("add_contact", {"name": "Zoe Park", "phone": "555-0101"})]  # "name" is an argument
    answer = parse_action("All done: the account {ACC-1} is frozen.")
    assert answer.is_answer and answer.text == "All done: the account {ACC-1} is frozen."
    assert parse_action('The data was {"balance": 5}.').is_answer  # JSON that is not a call
    assert parse_action('{"tool": "a", "x": ').error is not None  # a call cut off mid-way
    assert parse_action("<tool_call>not json</tool_call>").error is not None
    assert "non-empty string" in parse_action('{"tool": 5}').error
    assert "must be a JSON object" in parse_action('{"name": "a", "arguments": [1]}').error


def test_format_and_templates():
    call = ToolCall("freeze_account", {"account_id": "ACC-9"})
    assert format_call(call) == '{"name": "freeze_account", "arguments": {"account_id": "ACC-9"}}'
    assert format_call(call, "flat") == '{"tool": "freeze_account", "account_id": "ACC-9"}'
    assert parse_action(format_call(call, "flat")).calls == [call]
    tool = {
        "name": "freeze_account",
        "description": "Freeze an account.",
        "parameters": {
            "type": "object",
            "properties": {"account_id": {"type": "string", "description": 'The id, for example "ACC-1042".'}},
            "required": ["account_id"],
        },
    }
    assert call_template(tool) == '{"tool": "freeze_account", "account_id": "ACC-1042"}'
    text = tool_call_instructions(
        [tool],
        examples=[
            {
                "task": "Freeze account ACC-7.",
                "call": {"name": "freeze_account", "arguments": {"account_id": "ACC-7"}},
                "result": '{"success": true}',
            },
        ],
    )
    assert text.startswith('Tools:\n{"tool": "freeze_account", "account_id": "ACC-1042"}  # Freeze an account.')
    assert 'User: Freeze account ACC-7.\nAssistant: {"tool": "freeze_account", "account_id": "ACC-7"}' in text
    assert 'Tool: {"success": true}\nAssistant: Done.' in text
    with pytest.raises(ValueError):
        tool_call_instructions([tool], style="xml")


def test_example_values():
    assert example_value({"type": "string", "description": 'An id, for example "L-2".'}) == "L-2"
    assert example_value({"type": "integer", "description": "Nights, for example 3."}) == 3
    assert example_value({"type": "number", "description": "Price, e.g. 2.5"}) == 2.5
    assert example_value({"type": "string", "examples": ["x"]}) == "x"
    assert example_value({"type": "string", "enum": ["low", "high"]}) == "low"
    assert example_value({"type": "boolean"}) is False and example_value({"type": "string"}) == "..."


def test_validate_arguments():
    tool = normalize_tool(
        json.dumps(
            {
                "type": "function",
                "function": {
                    "name": "book",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "nights": {"type": "integer"},
                            "price": {"type": "number"},
                            "kind": {"type": "string", "enum": ["flight", "hotel"]},
                            "late": {"type": "boolean"},
                        },
                        "required": ["nights"],
                    },
                },
            }
        )
    )
    assert validate_arguments(tool, {"nights": 2}) == ({"nights": 2}, None)
    # lenient conversions a small model needs
    assert validate_arguments(tool, {"nights": "3", "price": "9.5", "late": "true"})[0] == {
        "nights": 3,
        "price": 9.5,
        "late": True,
    }
    assert validate_arguments(tool, {"nights": 2.0})[0] == {"nights": 2}
    assert "missing required" in validate_arguments(tool, {})[1]
    assert "unknown argument(s) 'room'" in validate_arguments(tool, {"nights": 1, "room": 2})[1]
    assert "must be of type integer" in validate_arguments(tool, {"nights": "two"})[1]
    assert "must be of type integer" in validate_arguments(tool, {"nights": True})[1]
    assert "must be one of" in validate_arguments(tool, {"nights": 1, "kind": "car"})[1]


def test_schema_from_a_method():
    class Env:
        def move(self, source: str, count: int, fast: bool = False) -> dict:
            """Move things somewhere.

            Args:
                source: Where from, for example "/a".
                count: How many.
                fast: Skip checks.
            """
            return {}

    schema = schema_from_method(Env.move)
    assert schema["name"] == "move" and schema["description"] == "Move things somewhere."
    assert schema["parameters"]["required"] == ["source", "count"]
    props = schema["parameters"]["properties"]
    assert props["source"] == {"type": "string", "description": 'Where from, for example "/a".'}
    assert props["count"]["type"] == "integer" and props["fast"] == {
        "type": "boolean",
        "description": "Skip checks.",
        "default": False,
    }
