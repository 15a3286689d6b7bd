"""Tool calls in chat completions: the model's `<tool_call>` text -> OpenAI `tool_calls`, and back for the prompt.

Qwen2.5 (and Hermes) chat templates render the offered tools into the system prompt and teach the model to call
one as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; the builtin tiny models use the same
format, so a real model behaves the same way. Parsing only shapes the message the client sees: the token ids
returned beside it are still exactly what was sampled.

`tool_choice` "required" or a named function is enforced: the reply is sampled under a grammar of these blocks
(lightning_sdk/constraint.py). Under "auto" a reply without a call comes back as plain content, never as an
invented call; "none" turns parsing off.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ToolCallError(ValueError):
    """A request whose tools, tool_choice or tool messages are malformed; `param` names the field (HTTP 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_tools(tools: list[dict] | None, tool_choice: Any) -> bool:
    """Validate `tools`/`tool_choice`; True when the reply should be parsed for tool calls."""
    names = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolCallError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., "
                                f"'parameters': {{...}}}}}}", f"tools.{i}")
        names.append(fn["name"])
    if tool_choice is None:
        return bool(names)
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not names:
            raise ToolCallError("tool_choice 'required' needs at least one tool in `tools`", "tool_choice")
        return tool_choice != "none" and bool(names)
    wanted = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(wanted, str):
        raise ToolCallError(f"tool_choice {tool_choice!r}: expected 'none', 'auto', 'required' or "
                            f"{{'type': 'function', 'function': {{'name': ...}}}}", "tool_choice")
    if wanted not in names:
        raise ToolCallError(f"tool_choice names function {wanted!r}, which is not in `tools` ({names})",
                            "tool_choice")
    return True


def prompt_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages -> what chat templates expect: tool-call arguments as objects, not JSON strings."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not calls:
            out.append(m)
            continue
        if not isinstance(calls, list):
            raise ToolCallError(f"messages[{i}].tool_calls: expected a list", f"messages.{i}.tool_calls")
        fixed = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            where = f"messages.{i}.tool_calls.{j}.function"
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ToolCallError(f"messages[{i}].tool_calls[{j}]: expected a function with a name", where)
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    raise ToolCallError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON "
                                        f"({e.msg})", f"{where}.arguments") from None
                except RecursionError:  # a 2 KB "[[[[..." is past Python's recursion limit: this call's fault
                    raise ToolCallError(f"messages[{i}].tool_calls[{j}].function.arguments is nested too deeply "
                                        f"to parse as JSON", f"{where}.arguments") from None
            fixed.append({**call, "function": {**fn, "arguments": args}})
        out.append({**m, "tool_calls": fixed})
    return out


def _tool_call(payload: str) -> dict | None:
    """One `<tool_call>` body -> an OpenAI tool call, or None when it is not a well-formed call."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments already encoded
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}


@dataclass
class ToolCallParser:
    """Splits a reply, fed piece by piece as it streams, into content text and tool calls.

    The whole-reply parse is the same parser fed once, so a streamed reply and a plain one agree. Text that might
    still become `<tool_call>` is held back; leading and trailing whitespace is dropped. A block that is not valid JSON
    with a name stays in the content, as the model wrote it.
    """

    buffer: str = ""
    inside: bool = False
    started: bool = False  # some content was emitted (leading whitespace is dropped before it)
    held: str = ""  # trailing whitespace, emitted only if more content follows
    calls: list[dict] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, new = [], []
        while True:
            if self.inside:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break
                body, self.buffer, self.inside = self.buffer[:end], self.buffer[end + len(CLOSE):], False
                call = _tool_call(body)
                if call is None:
                    content.append(OPEN + body + CLOSE)
                else:
                    new.append(call)
                continue
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buffer)
                content.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            content.append(self.buffer[:start])
            self.buffer, self.inside = self.buffer[start + len(OPEN):], True
        self.calls += new
        return self._emit("".join(content), final=False), new

    def finish(self) -> tuple[str, list[dict]]:
        """What is left at the end: an unterminated call still counts if its body is a complete call."""
        rest, new = self.buffer, []
        self.buffer = ""
        if self.inside:
            call = _tool_call(rest)
            if call is None:
                rest = OPEN + rest
            else:
                new, rest = [call], ""
            self.inside = False
        self.calls += new
        return self._emit(rest, final=True), new

    def _emit(self, text: str, *, final: bool) -> str:
        # Whitespace is held until text follows it, so none trails the content and none pads the calls.
        text = self.held + text
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        self.held = "" if final else text[len(body):]
        if body:
            self.started = True
        return body


def _partial_suffix(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def parse(text: str) -> tuple[str | None, list[dict]]:
    """A whole reply -> (content or None, tool calls)."""
    p = ToolCallParser()
    head, _ = p.feed(text)
    tail, _ = p.finish()
    content = head + tail
    return (content or None), p.calls


def _finish_reason(reason: str | None, calls: list[dict]) -> str | None:
    # A reply that ended on its own after calling a tool ends with "tool_calls", as OpenAI's do.
    return "tool_calls" if calls and reason == "stop" else reason


def message(text: str, finish_reason: str, parse_calls: bool) -> tuple[dict, str]:
    """The assistant message of a whole reply, and its finish_reason."""
    if not parse_calls:
        return {"role": "assistant", "content": text, "tool_calls": []}, finish_reason
    content, calls = parse(text)
    return {"role": "assistant", "content": content, "tool_calls": calls}, _finish_reason(finish_reason, calls)


class StreamShaper:
    """Per-choice parsers for a streamed reply: each sampled delta -> an OpenAI chunk delta and finish_reason."""

    def __init__(self, n: int, parse_calls: bool):
        self.parsers = [ToolCallParser() for _ in range(n)] if parse_calls else None

    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        if self.parsers is None:
            return {"content": text}, finish_reason
        p = self.parsers[index]
        before = len(p.calls)
        content, _ = p.feed(text)
        if finish_reason is not None:
            tail, _ = p.finish()
            content += tail
        delta: dict[str, Any] = {"content": content}
        new = p.calls[before:]
        if new:
            delta["tool_calls"] = [{"index": before + k, **call} for k, call in enumerate(new)]
        return delta, _finish_reason(finish_reason, p.calls) if finish_reason is not None else None
