"""The chat side of a code problem: the messages asking for a solution (`code_messages`, `code_instruction`) and
the code taken from a reply (`extract_code`: a fenced block, else the raw text)."""

from __future__ import annotations

import re

from lopd_core.conversation import Message
from lopd_core.evaluation.code.problems import CodeProblem

CODE_SYSTEM_PROMPT = "You are an expert Python programmer. You write correct, efficient and complete Python code."


def code_instruction(problem: CodeProblem) -> str:
    """The user message asking for a solution."""
    if problem.test_kind in ("stdio", "functional"):
        parts = [f"Solve the following programming problem in Python.\n\n{problem.prompt.strip()}"]
        if problem.starter_code.strip():
            parts.append(
                "Complete the following starter code and reply with the complete solution in one ```python code "
                f"block:\n```python\n{problem.starter_code.rstrip()}\n```"
            )
        else:
            parts.append(
                "Read the input from standard input and write the answer to standard output. Reply with the "
                "complete program in one ```python code block."
            )
        return "\n\n".join(parts)
    name = f" `{problem.entry_point}`" if problem.entry_point else ""
    return (
        f"Complete the following Python function{name}. Reply with the complete function, including its signature "
        f"and any imports it needs, in one ```python code block.\n\n```python\n{problem.prompt.rstrip()}\n```"
    )


def code_messages(problem: CodeProblem) -> list[Message]:
    return [Message("system", CODE_SYSTEM_PROMPT), Message("user", code_instruction(problem))]


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_START = re.compile(r"^(def |class |import |from |async def |@|if __name__)", re.MULTILINE)


def defines(code: str, name: str) -> bool:
    """Whether `code` defines a top-level-or-nested function/class called `name`."""
    return bool(name) and re.search(rf"^\s*(async\s+)?(def|class)\s+{re.escape(name)}\s*[(:]", code, re.M) is not None


def extract_code(reply: str, entry_point: str = "") -> str:
    """The code in a model reply: the fenced block that defines `entry_point` (else the first python block,
    else the first block; an unclosed final fence counts), or, without fences, the raw reply from its first
    line that looks like code."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(reply)]
    if blocks:
        for _, body in blocks:
            if entry_point and defines(body, entry_point):
                return body.strip("\n")
        for lang, body in blocks:
            if lang in ("python", "py", "python3"):
                return body.strip("\n")
        return blocks[0][1].strip("\n")
    text = reply.strip("\n")
    match = _CODE_START.search(text)
    if match and match.start() > 0 and not text[: match.start()].lstrip().startswith((" ", "\t")):
        text = text[match.start() :]
    return text
