"""What the agent says to the model: the system prompt, the worked example, tool results.

The system prompt and the example are the conversation's stable head: the same for every
question, so every turn after the first finds them cached (and turnkv names them with the
session's prefix ID).
"""

from __future__ import annotations

from typing import Any

from .calls import FORMAT_REMINDER, ToolCall
from .tools import ToolSpec

Message = dict[str, Any]


def system_prompt(specs: dict[str, ToolSpec], folder: str, files: list[str], *,
                  native: bool) -> str:
    shown = ", ".join(files[:30]) + (", ..." if len(files) > 30 else "")
    head = (f"You are a coding agent. You answer questions about the files in the folder "
            f"{folder} by looking at them with tools.\nThe folder holds: {shown}.\n")
    if native:
        return head + ("Call a tool to look at the files before you answer. Answer in one or "
                       "two sentences, naming the file you found it in.")
    tools = "\n".join(f"{spec.usage():<32} {spec.description}" for spec in specs.values())
    return head + (f"Tools:\n{tools}\n"
                   "Reply with exactly one line: a tool call, or, once a tool result has "
                   "shown you what you need, the answer:\n"
                   "ANSWER: <the answer, in one or two sentences>")


def worked_example(native: bool) -> list[Message]:
    """One question solved in the textual format: small models copy its shape far better
    than they follow a description. Strong models with native tools need none."""
    if native:
        return []
    # The answer copies the line that holds the fact: SmolLM2 does that well, where an answer
    # in words of its own ("The project needs ...") was copied instead, whatever the question.
    return [
        question("Which Python version does the project need?"),
        {"role": "assistant", "content": "CALL read_file setup.cfg"},
        {"role": "user", "content": "Tool result (read_file setup.cfg):\n"
                                    "[options]\npython_requires = >=3.10"},
        {"role": "assistant", "content": "ANSWER: python_requires = >=3.10"},
    ]


def question(text: str) -> Message:
    return {"role": "user", "content": f"Question: {text}"}


def tool_result(call: ToolCall, result: str, *, ok: bool, native: bool) -> Message:
    if native and call.call_id is not None:
        return {"role": "tool", "tool_call_id": call.call_id,
                "content": result if ok else f"Error: {result}"}
    label = "Tool result" if ok else "Tool error"
    return {"role": "user", "content": f"{label} ({call.describe()}):\n{result}"}


def format_problem(problem: str) -> Message:
    return {"role": "user", "content": f"I could not read your reply: {problem}. "
                                       f"{FORMAT_REMINDER}"}


def answer_now() -> Message:
    return {"role": "user", "content": "That was the last tool call for this question. "
                                       "Reply with ANSWER: and your best answer."}
