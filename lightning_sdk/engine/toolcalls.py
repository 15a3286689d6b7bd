"""Tool calls in chat completions: the model's own call text -> OpenAI `tool_calls` (and its reasoning ->
`reasoning_content`), and prior calls back for the prompt.

Each family writes calls its own way; `ToolFormat` reads one (`FORMATS`, by vLLM's --tool-call-parser name, chosen
per model by lightning_sdk/models/tool_parsers.py for both backends):
- hermes (Qwen2.5, Qwen3, the builtin tiny models): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
- llama3_json (Llama 3.x): `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, call ids of 9 letters and digits (its template's rule)
- openai (gpt-oss): harmony messages; `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}` is a
  call, the analysis channel is reasoning, the final channel the content
- pythonic (Gemma 3, which has no call tokens of its own): `[name(a=1, b="x"), ...]`
Qwen3's `<think>...</think>` is split off into `reasoning_content` as vLLM's qwen3 reasoning parser does (`Thinking`).
Parsing only shapes the message the client sees: the token ids returned beside it are still exactly what was sampled.

`tool_choice` "required" or a named function is enforced: the reply is sampled under the format's grammar of a call
(lightning_sdk/constraint.py's format_grammar: what vLLM applies for the same request; mistral and pythonic then
write bare JSON, read as vLLM reads it). Under "auto" a reply reads as vLLM's parser for the family reads it, except
where that would drop the model's text or make a call of what is not one: what is not a well-formed call (a name that
is a string, arguments a JSON object that JSON can hold: no NaN or Infinity) stays in the content, never an invented
call. "none", or no tools, turns call parsing off (gpt-oss's channels are still split: a call message is dropped, as
vLLM drops it).
"""

from __future__ import annotations

import ast
import json
import secrets
import string
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
    args = _arguments(obj.get("arguments", obj.get("parameters", {})))
    if args is None:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args}}


def _arguments(args: Any) -> str | None:
    """A call's arguments as the text of a JSON object, or None where they are not one (the call is malformed):
    some models write them already encoded; NaN and Infinity, which Python reads and JSON has not, are refused."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    try:
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return None


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
                keep = _partial(self.buffer, OPEN)
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


@dataclass
class Reply:
    """A reply (or the part of it streamed so far) read: its content, its complete tool calls, its reasoning."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)
    reasoning: str = ""


@dataclass(frozen=True)
class Forced:
    """A forced tool_choice, which decides how mistral's and pythonic's bare-JSON calls read: `name` for a named
    function (None: "required")."""

    name: str | None = None


def forced_choice(tool_choice: Any) -> Forced | None:
    if tool_choice == "required":
        return Forced()
    if isinstance(tool_choice, dict):
        return Forced(tool_choice.get("function", {}).get("name"))
    return None


class ToolFormat:
    """How one family writes tool calls. `scan` reads the text so far: with `final` False it holds back whatever
    may still become a call (content it returns is never taken back by a longer text); calls are complete ones.
    `skip_special_tokens`: False where the format's markers are special tokens (the text keeps them)."""

    name = ""
    skip_special_tokens = True

    def scan(self, text: str, final: bool, forced: Forced | None) -> Reply:
        raise NotImplementedError

    def call(self, name: str, arguments: str) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def without_calls(self) -> ToolFormat | None:
        """How replies read when the request parses no calls (tool_choice "none", no tools): None, as plain text;
        a format that also carries the reasoning keeps reading it."""
        return None


class Hermes(ToolFormat):
    name = "hermes"

    def scan(self, text: str, final: bool, forced: Forced | None) -> Reply:
        p = ToolCallParser()
        content, _ = p.feed(text)
        if final:
            content += p.finish()[0]
        return Reply(content, p.calls)


class Llama3Json(ToolFormat):
    """vLLM's llama3_json parser as it streams: a reply that starts (after whitespace) with `<|python_tag|>` or `{`
    is read as JSON objects with a name and parameters (or arguments), `;` or whitespace between them; any other
    text around them, or an object that is not a call, makes the whole reply content, as does a reply starting
    with anything else (vLLM's whole-reply parse would take calls out of prose and drop the prose: it disagrees with
    its own stream)."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool, forced: Forced | None) -> Reply:
        head = text.lstrip()
        calls_first = head.startswith(("{", self.TAG))
        if not final:  # a reply that starts as a call is held whole; any other is content from its first letter
            return Reply() if not head or calls_first or self.TAG.startswith(head) else Reply(text)
        if not calls_first:
            return Reply(text)
        body = head[len(self.TAG):] if head.startswith(self.TAG) else head
        calls, decoder, i = [], json.JSONDecoder(), 0
        while True:
            while i < len(body) and (body[i] == ";" or body[i].isspace()):
                i += 1
            if i == len(body):
                break
            try:
                obj, i = decoder.raw_decode(body, i)
            except (ValueError, RecursionError):
                return Reply(text)
            args = _arguments(obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None
            if args is None or not isinstance(obj.get("name"), str) or not obj["name"]:
                return Reply(text)
            calls.append(self.call(obj["name"], args))
        return Reply("", calls) if calls else Reply(text)


class Mistral(ToolFormat):
    """vLLM's mistral parser with a Hugging Face tokenizer (its pre-v11 branch): content, then `[TOOL_CALLS]` and a
    JSON array of calls (or one call object); a forced call is the bare array. Markers repeated with nothing between
    them count as one; text after the array is content, as vLLM streams it (its markers dropped). Where the JSON is
    not all calls (each with a name), the whole reply is content."""

    name = "mistral"
    TAG = "[TOOL_CALLS]"
    skip_special_tokens = False  # [TOOL_CALLS] is a control token: vLLM keeps special tokens with tools too
    ID_CHARS = string.ascii_letters + string.digits

    def call(self, name: str, arguments: str) -> dict:
        return {"id": "".join(secrets.choice(self.ID_CHARS) for _ in range(9)), "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def scan(self, text: str, final: bool, forced: Forced | None) -> Reply:
        if not final:
            if forced is not None:
                return Reply()
            cut = text.find(self.TAG)
            head = text if cut < 0 else text[:cut]
            head = head[:len(head) - _partial(head, self.TAG)]
            return Reply(head if head.strip() else "")  # blank before a call is no content
        cut = text.find(self.TAG)
        if cut >= 0:
            content, body = text[:cut], text[cut:]
        elif forced is not None:
            content, body = "", text
        else:
            return Reply(text)
        while body.lstrip().startswith(self.TAG):
            body = body.lstrip()[len(self.TAG):]
        body = body.lstrip()
        try:
            parsed, end = json.JSONDecoder().raw_decode(body)
        except (ValueError, RecursionError):
            return Reply(text)
        items = [parsed] if isinstance(parsed, dict) else parsed if isinstance(parsed, list) else []
        calls = []
        for item in items:
            args = _arguments("{}" if item.get("arguments") is None else item["arguments"]) \
                if isinstance(item, dict) else None
            if args is None or not isinstance(item.get("name"), str) or not item["name"]:
                return Reply(text)
            calls.append(self.call(item["name"], args))
        if not calls:
            return Reply(text)
        tail = body[end:].replace(self.TAG, "")
        content += tail if tail.strip() else ""
        return Reply(content if content.strip() else "", calls)


class Pythonic(ToolFormat):
    """vLLM's pythonic parser (`[f(a=1), g()]`, literal arguments); a forced call is vLLM's generic bare JSON: a
    named call's arguments alone, or `[{"name": ..., "parameters": ...}]`."""

    name = "pythonic"

    def scan(self, text: str, final: bool, forced: Forced | None) -> Reply:
        if not final:
            head = text.lstrip()
            return Reply() if forced is not None or not head or head.startswith("[") else Reply(text)
        if forced is not None:
            return _forced_json(self, text, forced)
        stripped = text.strip()
        if not (stripped.startswith("[") and stripped.endswith("]")):
            return Reply(text)
        try:
            tree = ast.parse(stripped, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return Reply(text)
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    return Reply(text)
                args = _arguments({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None})
                if args is None:  # a value JSON cannot hold (1e999, a set): not a call
                    return Reply(text)
                calls.append(self.call(node.func.id, args))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return Reply(text)
        return Reply("", calls)


def _forced_json(fmt: ToolFormat, text: str, forced: Forced) -> Reply:
    """vLLM's own reading of a forced call sampled as bare JSON: a named function's arguments, or a list of
    `{"name", "parameters"}`."""
    if forced.name is not None:
        return Reply("", [fmt.call(forced.name, text.strip())]) if _arguments(text) is not None else Reply(text)
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return Reply(text)
    calls = []
    for item in items if isinstance(items, list) else []:
        args = _arguments(item.get("parameters", {})) if isinstance(item, dict) else None
        if args is None or not isinstance(item.get("name"), str) or not item["name"]:
            return Reply(text)
        calls.append(fmt.call(item["name"], args))
    return Reply("", calls) if calls else Reply(text)


class Harmony(ToolFormat):
    """gpt-oss's harmony messages (vLLM's openai parser and openai_gptoss reasoning): each `[<|start|>assistant]
    <|channel|>C[ to=functions.NAME][ <|constrain|>json]<|message|>BODY<|end|>`; the last ends with a stop token
    (not in the text). Analysis is reasoning, a message to functions.NAME a call (with `calls` False, when the
    request parses no calls, dropped, as vLLM drops it), the rest content.

    Every message before the last `<|start|>` is complete, so their reading is kept and a longer text of a stream
    reads only what it adds (one per stream of the same reader: the choices of one request)."""

    name = "openai"
    skip_special_tokens = False  # the channels are special tokens
    START, MESSAGE, ENDS = "<|start|>", "<|message|>", ("<|end|>", "<|call|>", "<|return|>")
    KEPT = 64  # streams whose complete messages are kept: a request's choices

    def __init__(self, calls: bool = True):
        self.calls = calls
        self.kept: list[tuple[str, Reply]] = []  # (text of complete messages, its reading)

    def without_calls(self) -> ToolFormat | None:
        return Harmony(calls=False)

    def scan(self, text: str, final: bool, forced: Forced | None) -> Reply:
        if self.MESSAGE not in text:  # not (yet) a harmony message: what the model wrote, at the end
            return Reply(text if final else "")
        cut = max(text.rfind(self.START), 0)
        done = self._complete(text[:cut])
        last = self._read(text[cut:], complete=final)
        return Reply(done.content + last.content, done.calls + last.calls, done.reasoning + last.reasoning)

    def _complete(self, text: str) -> Reply:
        """The reading of complete messages, from the reading kept of the longest start of them read before."""
        if not text:
            return Reply()
        k, seen, reply = next(((k, seen, reply) for k, (seen, reply) in enumerate(self.kept)
                               if text.startswith(seen) and text.startswith(self.START, len(seen))),
                              (None, "", Reply()))
        more = self._read(text[len(seen):], complete=True)
        reply = Reply(reply.content + more.content, reply.calls + more.calls, reply.reasoning + more.reasoning)
        if k is not None:
            del self.kept[k]
        self.kept = [(text, reply)] + self.kept[:self.KEPT - 1]
        return reply

    def _read(self, text: str, complete: bool) -> Reply:
        """Messages, all but the last complete (all of them with `complete`)."""
        out = Reply()
        parts = text.split(self.START)
        for k, part in enumerate(parts):
            if k:  # the role after <|start|>
                part = part[len("assistant"):] if part.startswith("assistant") else part
            head, sep, body = part.partition(self.MESSAGE)
            if not sep:
                continue
            done = complete or k < len(parts) - 1 or any(body.endswith(e) for e in self.ENDS)
            for e in self.ENDS:
                body = body.split(e)[0]
            recipient = next((w[len("to="):] for w in head.replace("<|", " <|").split() if w.startswith("to=")), None)
            channel = head.split("<|channel|>")[-1].split()[0].split("<|")[0] if "<|channel|>" in head else ""
            if recipient is not None and recipient.startswith("functions."):
                if done and self.calls and _arguments(body) is not None:
                    out.calls.append(self.call(recipient[len("functions."):], body.strip()))
                elif done and self.calls:  # cut short (max_tokens): its text, not a call
                    out.content += body
                continue
            if not done:
                body = body[:len(body) - max(_partial(body, e) for e in self.ENDS + (self.START,))]
            if channel == "analysis":
                out.reasoning += body
            else:
                out.content += body
        return out


FORMATS: dict[str, type[ToolFormat]] = {f.name: f for f in (Hermes, Llama3Json, Mistral, Harmony, Pythonic)}


def tool_format(parser: str | None) -> ToolFormat:
    """The reader of vLLM's tool-call parser `parser` (hermes where the model names none this server reads)."""
    return FORMATS.get(parser or "", Hermes)()


class Thinking:
    """vLLM's qwen3 (and deepseek_r1) reasoning parser: what comes before `</think>` is reasoning (a leading `<think>`
    dropped), or before a `<tool_call>` that starts first; with no end, all of it is, unless the prompt already
    closed the thinking (`closed`: the template's empty `<think></think>`, thinking off)."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, closed: bool):
        self.closed = closed

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        """(reasoning, the rest: None while still in the reasoning)."""
        if self.closed:
            return "", text
        body = text[len(self.OPEN):] if text.startswith(self.OPEN) else text
        ends = [(i, len(m)) for m in (self.CLOSE, OPEN) if (i := body.find(m)) >= 0]
        if ends:
            i, n = min(ends)
            return body[:i], body[i + n:] if body[i:i + n] == self.CLOSE else body[i:]
        if final:
            return body, None
        if self.OPEN.startswith(text):  # may still become <think>, which is not reasoning
            return "", None
        return body[:len(body) - max(_partial(body, self.CLOSE), _partial(body, OPEN))], None


def _partial(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class Reader:
    """A model's replies read: its tool-call format (None: calls not parsed, `tool_choice` "none" or no tools),
    its reasoning split (None: the model does not reason, or the format splits it itself) and the forced choice."""

    fmt: ToolFormat | None
    thinking: Thinking | None = None
    forced: Forced | None = None

    def read(self, text: str, final: bool) -> Reply:
        reasoning, rest = self.thinking.split(text, final) if self.thinking is not None else ("", text)
        if rest is None:
            return Reply(reasoning=reasoning)
        if self.fmt is None:
            reply = Reply(rest)
        else:
            reply = self.fmt.scan(rest, final, self.forced)
        if self.thinking is not None:
            reply.reasoning = reasoning
        return reply


def message(text: str, finish_reason: str, reader: Reader) -> tuple[dict, str]:
    """The assistant message of a whole reply, and its finish_reason."""
    reply = reader.read(text, final=True)
    plain = reader.fmt is None and reader.thinking is None  # the text as sampled, "" included
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content if reply.content or plain else None,
                           "tool_calls": reply.calls}
    if reply.reasoning:
        msg["reasoning_content"] = reply.reasoning
    return msg, _finish_reason(finish_reason, reply.calls)


class StreamShaper:
    """Per-choice readers for a streamed reply: each sampled delta -> an OpenAI chunk delta and finish_reason. The
    text so far is read again at each delta and only what it adds is sent, so a streamed reply and a plain one
    agree (calls are sent whole, once complete)."""

    def __init__(self, n: int, reader: Reader):
        self.reader = reader
        self.text = [""] * n
        self.sent = [Reply() for _ in range(n)]  # content and reasoning lengths sent, calls sent

    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        self.text[index] += text
        reply = self.reader.read(self.text[index], final=finish_reason is not None)
        sent = self.sent[index]
        delta: dict[str, Any] = {"content": reply.content[len(sent.content):]}
        if len(reply.reasoning) > len(sent.reasoning):
            delta["reasoning_content"] = reply.reasoning[len(sent.reasoning):]
        new = reply.calls[len(sent.calls):]
        if new:
            delta["tool_calls"] = [{"index": len(sent.calls) + k, **call} for k, call in enumerate(new)]
        self.sent[index] = Reply(reply.content, sent.calls + new, reply.reasoning)
        return delta, _finish_reason(finish_reason, self.sent[index].calls) if finish_reason is not None else None
