"""A call's output constraint (structured outputs), read once from the request in one canonical form.

The same request means the same thing on the built-in server and on vLLM: OpenAI's `response_format` (json_schema,
json_object), vLLM's `structured_outputs` (json, regex, choice, grammar, json_object: vLLM 0.32's names) and the
tool calls of a request that offers tools. The built-in server samples under it; the gateway records it by value
(`to_json`) in the call's record, so that the trainer replays the same grammar over the sampled ids and scores each
token under the same allowed set (lightning_sdk/grammar.py compiles it; nothing here needs the grammar engine).
JSON is compact (no free whitespace between tokens): a free whitespace run lets a small model fill its whole reply
with newlines; vLLM is started with the same setting (its disable_any_whitespace, a server-wide option it does not
take per request).

Tool calls follow vLLM 0.32 started with `--tool-strict-level parameter` (lightning_sdk/servers/vllm.py), which
builds a structural tag for every request that offers tools (tool_choice unset or "auto", "required", a named
function; not "none") with each tool's arguments pinned to its parameter schema, as if every tool were
`"strict": true` (without that level a tool lacking `strict` gets free JSON arguments, and an "auto" request no
grammar at all). The tag (grammar.py builds it as vLLM's hermes tool parser does) writes a call as
`<tool_call>\n{"name": "x", "arguments": {...}}\n</tool_call>` or the same without the two newlines, the arguments
with free whitespace on vLLM (its disable_any_whitespace does not reach a structural tag) and compact on the built-in
server (json.dumps' separators: a model never taught calls fills free whitespace with newlines; `ServerGrammar`
says which, and the gateway records it with the constraint); "auto" leaves the text free
until `<tool_call>` begins a call, "required" asks for one call or more (none between them), a named function for
one call, `parallel_tool_calls: false` for at most one; "auto" with a `response_format` or `structured_outputs`
is one call or more, or a reply in that format. That reply's JSON sits in the same structural tag, so it follows
the tag's whitespace rule, not a plain response format's: free whitespace on vLLM, and on the built-in server
compact with json.dumps' separators (", " and ": ", grammar.compact_tag), where a plain response format is
compact with "," and ":". Under mistral and pythonic (no call grammar for "auto": format_grammar) the format is
compiled alone, compact with "," and ":" on both backends.

`check_size` bounds a constraint before it is compiled: compiling cannot be interrupted, and its cost grows far
faster than its size (deep nesting, long enums, many optional properties, repetition counts: `a{0,4000}` in a
schema's pattern is expanded, and nested counts multiply), so these limits keep every compile short. Each is far
above what a real app's schema, tool set or grammar needs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

# vLLM's names before 0.12; vLLM 0.32 ignores them (with a warning) and samples unconstrained.
OLD_VLLM_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_calls", "structural_tag")
# The call's wrapper in Hermes / Qwen2.5 chat templates (and the builtin models'); vLLM's hermes tag takes it with
# the newlines and without them
TOOL_OPEN, TOOL_CLOSE = "<tool_call>\n", "\n</tool_call>"
# The tool-call formats (vLLM's --tool-call-parser names: models/tool_parsers.py picks one per model), each with
# its own forced-call grammar (`format_grammar`) and reply parser (engine/toolcalls.py).
TOOL_FORMATS = ("hermes", "llama3_json", "mistral", "openai", "pythonic")
DEFAULT_TOOL_FORMAT = "hermes"  # the builtin tiny models' format, and a model whose format nothing names

MAX_CONSTRAINT_BYTES = 256 * 1024  # the constraint's JSON text: a schema, all forced tools' parameters, a grammar
MAX_NESTING_DEPTH = 64  # JSON levels of a schema (an object property is two); brackets in a regex or grammar
MAX_ENUM_VALUES = 4096  # enum and const values of a schema, all together, or the choices of a choice
MAX_PROPERTIES = 1000  # properties of one object schema (optional ones make the grammar grow fastest)
MAX_GRAMMAR_RULES = 1000  # rules (`::=`) of an EBNF grammar
# `{n}`, `{n,m}`, `{n,}` in a schema's patterns, a regex or a grammar, all together: each counts its largest bound
# (n when open), times the counts of the repetitions it applies to (a group's, nested)
MAX_REPETITION = 1000
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")  # as xgrammar reads one (spaces allowed)


class ConstraintError(ValueError):
    """A constraint that is malformed or cannot be served; `param` names the request's part (an HTTP 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ServerGrammar:
    """How a backend turns a request's constraint into the grammar it samples under, beyond the request itself:
    the tool-call parser it was started with (vLLM's --tool-call-parser name, `tool_parsers.choose(serve.
    tool_call_parser, detected)`; None: none), its reasoning parser (Qwen3's: the grammar starts where the thinking
    ends) and whether JSON inside a structural tag (tool-call arguments) is `compact` (json.dumps' separators: the
    built-in server) or takes free whitespace (vLLM, whose structural tags ignore disable_any_whitespace). The
    gateway records it with each constraint, so the trainer replays what that server applied."""

    tool_parser: str | None
    reasoning_parser: str | None
    compact: bool

    @property
    def tool_format(self) -> str:
        """The forced-call grammar's format (TOOL_FORMATS) of this server's tool-call parser."""
        return grammar_format(self.tool_parser)

    def to_dict(self) -> dict[str, Any]:
        return {"tool_parser": self.tool_parser, "reasoning_parser": self.reasoning_parser, "compact": self.compact}

    @classmethod
    def from_dict(cls, d: Any) -> "ServerGrammar":
        if not isinstance(d, dict) or not isinstance(d.get("compact"), bool):
            raise ConstraintError(f"not a recorded server grammar: {str(d)[:200]!r}", "constraint")
        tools, reasoning = d.get("tool_parser"), d.get("reasoning_parser")
        return cls(tools if isinstance(tools, str) else None, reasoning if isinstance(reasoning, str) else None,
                   d["compact"])


@dataclass(frozen=True)
class Constraint:
    """What the sampler must follow: `kind` (KINDS) and its definition `spec` (a JSON value: the schema, the
    pattern, the choices, the EBNF grammar, or the tools and how many calls); `param` names where it came from;
    `server`, in a call's record, how the backend that served it applied it (None: a request's own, or a record
    made before records said: the trainer then replays it as the run's backend applied such records,
    train.trainer.unsaid_server)."""

    kind: str
    spec: Any
    param: str = ""
    server: ServerGrammar | None = None

    def to_json(self) -> str:
        """The text stored in the call's record. Never with sorted keys: a JSON schema's property order is the
        order the grammar writes the properties in."""
        d = {"kind": self.kind, "spec": self.spec, "param": self.param}
        if self.server is not None:
            d["server"] = self.server.to_dict()
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Constraint":
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("kind") not in KINDS:
            raise ConstraintError(f"not a recorded constraint: {text[:200]!r}", "constraint")
        server = ServerGrammar.from_dict(d["server"]) if d.get("server") is not None else None
        if d["kind"] == "tool_calls":
            _check_tool_calls(d.get("spec"), text)
        return cls(d["kind"], d.get("spec"), str(d.get("param", "")), server)

    @property
    def label(self) -> str:
        """A short human name: `json_schema Person`, `tool_calls search`, `regex`."""
        if self.kind == "json_schema" and isinstance(self.spec, dict) and isinstance(self.spec.get("title"), str):
            return f"json_schema {self.spec['title']}"
        if self.kind == "tool_calls":
            return "tool_calls " + ",".join(t["name"] for t in self.spec["tools"])
        return self.kind


TOOL_CHOICES = ("auto", "required", "named")  # a tool_calls spec's "choice" (absent: a forced call)
TEXT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")  # "auto" with a response format: its kind


def _check_tool_calls(spec: Any, text: str) -> None:
    """ConstraintError unless `spec` has the shape `_tool_calls` records (a stored record is untrusted): tools a
    non-empty list of {"name": str, "parameters": object or true}, one a bool, choice one of
    TOOL_CHOICES (or absent), text (if any) a response format of a TEXT_KINDS kind."""
    def bad(what: str) -> ConstraintError:
        return ConstraintError(f"not a recorded tool_calls constraint ({what}): {text[:200]!r}", "constraint")

    if not isinstance(spec, dict):
        raise bad("spec: expected an object")
    tools = spec.get("tools")
    if not isinstance(tools, list) or not tools:
        raise bad("spec.tools: expected a non-empty list")
    for t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise bad("spec.tools: expected objects with a string name")
        if not isinstance(t.get("parameters"), dict) and t.get("parameters") is not True:
            raise bad("spec.tools[].parameters: expected an object or true")
    if not isinstance(spec.get("one"), bool):
        raise bad("spec.one: expected true or false")
    if "choice" in spec and spec["choice"] not in TOOL_CHOICES:
        raise bad(f"spec.choice: expected one of {', '.join(TOOL_CHOICES)}")
    fmt = spec.get("text")
    if "text" in spec and (not isinstance(fmt, dict) or fmt.get("kind") not in TEXT_KINDS):
        raise bad(f"spec.text: expected a response format of kind {', '.join(TEXT_KINDS)}")


def check_size(c: Constraint) -> None:
    """ConstraintError naming the field and the limit if `c` is over one of this module's MAX_ limits (bytes: about
    the JSON text's length). Its cost is bounded by the limits, not by the input: it stops at the first one crossed."""
    text = c.spec.get("text") if c.kind == "tool_calls" and isinstance(c.spec, dict) else None
    spent = (0, 0)
    if isinstance(text, dict):  # "auto" with a response format: the format by its own rules, then the tools
        spent = _check_part(Constraint(text.get("kind", ""), text.get("spec"), c.param), *spent)
        c = Constraint(c.kind, {k: v for k, v in c.spec.items() if k != "text"}, c.param)
    _check_part(c, *spent)


def _check_part(c: Constraint, size: int, repeats: int) -> tuple[int, int]:
    """check_size of one part of a constraint, the bytes and repetitions of the parts before it counted in: the
    totals after it."""
    what = "grammar" if c.kind == "grammar" else "pattern" if c.kind == "regex" else "schema"
    if isinstance(c.spec, str):
        _check_text(c.spec, c.param, what, rules=c.kind == "grammar", before=size)
        return size + len(c.spec), _repetitions(c.spec, c.param, what, repeats, quoted=c.kind == "grammar")
    if c.kind == "choice" and isinstance(c.spec, list) and len(c.spec) > MAX_ENUM_VALUES:
        raise _over(c.param, f"{len(c.spec)} choices, more than", MAX_ENUM_VALUES)
    values, stack = 0, [(c.spec, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING_DEPTH:
            raise _over(c.param, f"the {what} is nested deeper than", MAX_NESTING_DEPTH, "levels")
        # brackets or quotes, and a comma per member: counted before the members are walked
        size += 2 + (2 * len(node) if isinstance(node, (dict, list)) else len(node) if isinstance(node, str) else 2)
        if size > MAX_CONSTRAINT_BYTES:
            raise _over(c.param, f"the {what} is larger than", MAX_CONSTRAINT_BYTES, "bytes")
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict) and len(props) > MAX_PROPERTIES:
                raise _over(c.param, f"an object of the {what} has {len(props)} properties, more than",
                            MAX_PROPERTIES)
            enum = node.get("enum")
            values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
            if values > MAX_ENUM_VALUES:
                raise _over(c.param, f"the {what} holds more enum/const values than", MAX_ENUM_VALUES)
            size += sum(len(k) for k in node)
            # patterns are scanned before their strings are counted: at most the limit's worth of text each
            pattern, keyed = node.get("pattern"), node.get("patternProperties")
            for text in ([pattern] if isinstance(pattern, str) else []) + (list(keyed) if isinstance(keyed, dict)
                                                                            else []):
                size += len(text)
                if size > MAX_CONSTRAINT_BYTES:
                    raise _over(c.param, f"the {what} is larger than", MAX_CONSTRAINT_BYTES, "bytes")
                repeats = _repetitions(text, c.param, what, repeats, quoted=False)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return size, repeats


def _check_text(text: str, param: str, what: str, *, rules: bool, before: int = 0) -> None:
    if before + len(text) > MAX_CONSTRAINT_BYTES:
        raise _over(param, f"the {what} is {before + len(text)} characters, more than", MAX_CONSTRAINT_BYTES)
    if rules and text.count("::=") > MAX_GRAMMAR_RULES:
        raise _over(param, f"the grammar has {text.count('::=')} rules, more than", MAX_GRAMMAR_RULES)
    depth, escaped = 0, False
    for ch in text:  # brackets outside escapes (a quoted one counts too: no real pattern nests near the limit)
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in "([{":
            depth += 1
            if depth > MAX_NESTING_DEPTH:
                raise _over(param, f"the {what} nests brackets deeper than", MAX_NESTING_DEPTH, "levels")
        elif ch in ")]}":
            depth = max(0, depth - 1)


def _repetitions(text: str, param: str, what: str, spent: int, *, quoted: bool) -> int:
    """`spent` plus the repetition `text` asks for (MAX_REPETITION), outside escapes, character classes and (in a
    grammar, `quoted`) string literals; ConstraintError as soon as the total passes the limit."""
    groups = [0]  # per open bracket: the repetition inside it so far
    last, i, n = 0, 0, len(text)  # last: the repetition inside the atom just read (a group's, or 0)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i, last = i + 2, 0
            continue
        if ch == "[" or (quoted and ch == '"'):
            end = "]" if ch == "[" else '"'
            i += 1 + (ch == "[" and text[i + 1:i + 2] == "^")
            i += ch == "[" and text[i:i + 1] == "]"  # a class's leading ] is a literal
            while i < n and text[i] != end:
                i += 2 if text[i] == "\\" else 1
            last = 0
        elif ch == "(":
            groups.append(0)
            last = 0
        elif ch == ")":
            last = groups.pop() if len(groups) > 1 else 0
            groups[-1] += last
        elif ch == "{" and (m := _REPEAT.match(text, i)):
            bound = m[3] if m[2] and m[3] else m[1]
            count = int(bound) if len(bound) <= 9 else 10**9  # no int() of a thousand digits
            grown = count * max(1, last) - last
            groups[-1] += grown
            spent += grown
            if spent > MAX_REPETITION:
                raise _over(param, f"the {what} asks for more repetition ({{n,m}} counts, nested ones multiplied) "
                                   f"than", MAX_REPETITION)
            last = count * max(1, last)
            i = m.end()
            continue
        else:
            last = 0
        i += 1
    return spent


def _over(param: str, what: str, limit: int, unit: str = "") -> ConstraintError:
    return ConstraintError(f"{param}: {what} this server's limit of {limit}{' ' + unit if unit else ''}", param)


def from_request(body: Mapping[str, Any]) -> Constraint | None:
    """The constraint a chat/completions request body asks for, or None. ConstraintError names a malformed part.

    As vLLM: `response_format` overrides `structured_outputs`. A forced tool_choice with either is refused: two
    grammars for one reply (vLLM ignores the format); "auto" with either is a call or a reply in that format."""
    fmt = _response_format(body.get("response_format"))
    so = _structured_outputs(body.get("structured_outputs"))
    tools = _tool_calls(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    text = fmt or so
    if tools is None or text is None:
        return text or tools
    if tools.spec["choice"] != "auto":
        raise ConstraintError(f"{text.param} and a forced tool_choice both constrain the reply; send one",
                              "tool_choice")
    return Constraint("tool_calls", {**tools.spec, "text": {"kind": text.kind, "spec": text.spec}}, text.param)


def _response_format(fmt: Any) -> Constraint | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ConstraintError("response_format: expected an object with a type", "response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", None, param="response_format")
    if kind == "json_schema":
        js = fmt.get("json_schema")
        # OpenAI's key is `schema`; vLLM's model also takes it as `json_schema`
        schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise ConstraintError("response_format.json_schema.schema: expected a JSON schema (an object)",
                                  "response_format.json_schema.schema")
        return Constraint("json_schema", schema, param="response_format.json_schema.schema")
    raise ConstraintError(f"response_format.type {kind!r} is not served: expected 'text', 'json_object' or "
                          f"'json_schema'", "response_format.type")


def _structured_outputs(so: Any) -> Constraint | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise ConstraintError("structured_outputs: expected an object (vLLM's StructuredOutputsParams)",
                              "structured_outputs")
    if so.get("structural_tag") is not None:
        raise ConstraintError("structured_outputs.structural_tag is not served by this server", 
                              "structured_outputs.structural_tag")
    if so.get("whitespace_pattern") is not None:
        raise ConstraintError("structured_outputs.whitespace_pattern is not served by this server",
                              "structured_outputs.whitespace_pattern")
    set_ = [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) is not None]
    if len(set_) != 1:
        raise ConstraintError(f"structured_outputs: expected exactly one of json, regex, choice, grammar, "
                              f"json_object (got {set_ or 'none'})", "structured_outputs")
    key, value = set_[0], so[set_[0]]
    param = f"structured_outputs.{key}"
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConstraintError(f"{param}: not valid JSON ({e})", param) from None
        if not isinstance(value, dict):
            raise ConstraintError(f"{param}: expected a JSON schema (an object)", param)
        return Constraint("json_schema", value, param)
    if key == "json_object":
        if value is not True:
            raise ConstraintError(f"{param}: expected true", param)
        return Constraint("json_object", None, param)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ConstraintError(f"{param}: expected a non-empty list of strings", param)
        return Constraint("choice", value, param)
    if not isinstance(value, str) or not value:
        raise ConstraintError(f"{param}: expected a non-empty string", param)
    return Constraint(key, value, param)


def _tool_calls(tools: Any, choice: Any, parallel: Any) -> Constraint | None:
    """The tool calls a request that offers tools may make: `choice` "auto" (tool_choice unset or "auto": text, or
    calls), "required" (one call or more of any tool) or "named" (one call of that function); `one` when at most
    one call may be made. Each tool's `parameters` as sent (true, any JSON, when it has none), as vLLM pins them."""
    if choice is None:
        choice = "auto"
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        return None  # "none", or a value engine/toolcalls.py refuses
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and not isinstance(named, str):
        return None
    out = []
    for tool in tools if isinstance(tools, list) else ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and (named is None or fn["name"] == named):
            params = fn.get("parameters")
            out.append({"name": fn["name"], "parameters": params if isinstance(params, dict) else True})
    if not out:  # engine/toolcalls.py names what is wrong with tools and tool_choice
        return None
    return Constraint("tool_calls", {"tools": out, "choice": "named" if named is not None else choice,
                                     "one": named is not None or parallel is False}, param="tool_choice")


# ---- the forced-call grammar of each tool-call format, as vLLM 0.32 applies it for the same request ----
#
# vLLM's tool parsers differ in how they force a call. hermes, llama3_json and openai (gpt-oss) carry a structural
# tag (vllm/tool_parsers/structural_tag_registry.py, xgrammar's builtin "llama", vllm/parser/harmony.py): a
# grammar over the model's own call markers, compiled as sent (free whitespace inside the JSON). mistral (with a
# Hugging Face tokenizer) and pythonic force a bare JSON value instead (vllm/parser/mistral.py's pre-v11 schema,
# vllm/tool_parsers/utils.py's get_json_schema_from_tools), compiled like any JSON schema (compact, as vLLM is
# started). The arguments follow the tool's parameters (vLLM's --tool-strict-level parameter); a tool without
# parameters takes any JSON value in a structural tag, as vLLM's.


def grammar_format(parser: str | None) -> str:
    """The tool format (TOOL_FORMATS) of vLLM's tool-call parser `parser`; DEFAULT_TOOL_FORMAT for one not here."""
    return parser if parser in TOOL_FORMATS else DEFAULT_TOOL_FORMAT


def format_grammar(c: Constraint, fmt: str) -> Constraint | None:
    """The constraint the model `fmt` (TOOL_FORMATS) is sampled under for `c` (None: none, vLLM leaves an "auto"
    call of mistral and pythonic free): tool calls become the format's grammar (kind "structural_tag" holds
    xgrammar's structural-tag JSON), a JSON constraint on gpt-oss goes in its final channel; anything else is `c`
    itself. hermes keeps kind "tool_calls" (grammar.py builds its tag)."""
    if fmt == "openai" and c.kind in ("json_schema", "json_object"):
        schema = c.spec if c.kind == "json_schema" else {"type": "object"}
        return Constraint("structural_tag", _harmony_final(schema), c.param)
    if c.kind != "tool_calls" or fmt == DEFAULT_TOOL_FORMAT or fmt not in TOOL_FORMATS:
        return c
    tools, single, text = c.spec["tools"], bool(c.spec["one"]), c.spec.get("text")
    # "choice": "auto", "required" or "named"; a spec without it is a forced call ("named" kept as a flag)
    choice = c.spec.get("choice") or ("named" if c.spec.get("named") else "required")
    if fmt in ("mistral", "pythonic") and choice == "auto":  # no grammar of calls: the response format, if any
        return None if text is None else Constraint(text["kind"], text.get("spec"), c.param)
    if fmt == "mistral":  # [{"name": ..., "arguments": ...}], a named call at most once
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["name"]]},
                                                   "arguments": _params(t, {"type": "object"})},
                  "required": ["name", "arguments"]} for t in tools]
        return Constraint("json_schema", {"type": "array", "minItems": 1,
                                          **({"maxItems": 1} if choice == "named" else {}),
                                          "items": {"type": "object", "anyOf": items}}, c.param)
    if fmt == "pythonic":  # a named call: its arguments alone; "required": [{"name": ..., "parameters": ...}]
        if choice == "named":
            return Constraint("json_schema", _params(tools[0], {"type": "object", "properties": {}}), c.param)
        items = [{"properties": {"name": {"type": "string", "enum": [t["name"]]},
                                 "parameters": _params(t, {"type": "object", "properties": {}})},
                  "required": ["name", "parameters"]} for t in tools]
        return Constraint("json_schema", {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items},
                                          **({"maxItems": 1} if single else {})}, c.param)
    if text is not None:  # "auto" with a response format: calls as "required" asks for them, or the format
        tools_tag = format_grammar(Constraint("tool_calls", {"tools": tools, "one": single, "choice": "required"},
                                              c.param), fmt)
        return Constraint("structural_tag", {"type": "structural_tag", "format": {"type": "or", "elements": [
            tools_tag.spec["format"], text_format(text["kind"], text.get("spec"))]}}, c.param)
    if fmt == "llama3_json":  # xgrammar's builtin "llama" tag
        tags = [_tag('{"name": "' + t["name"] + '", "parameters": ', _args(t), "}") for t in tools]
        if choice == "named":
            return Constraint("structural_tag", {"type": "structural_tag", "format": tags[0]}, c.param)
        return Constraint("structural_tag", {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ['{"name": '], "tags": tags, "excludes": ["<think>", "</think>"],
            "at_least_one": choice == "required", "stop_after_first": single}}, c.param)
    # openai: gpt-oss's harmony messages, optional analysis and commentary, then a call (or, "auto", a final one)
    tags = [_tag(begin.format(name=t["name"], channel=channel, constrain=constrain), _args(t), ["<|end|>", ""])
            for t in tools for begin in HARMONY_CALL_BEGINS for constrain in HARMONY_JSON_CONSTRAINS
            for channel in HARMONY_CALL_CHANNELS]
    if choice == "auto":
        tags += [_tag(f"<|channel|>final{constrain}<|message|>", {"type": "any_text"}, ["<|end|>", ""])
                 for constrain in HARMONY_JSON_CONSTRAINS + ("",)]
    return Constraint("structural_tag", _harmony(True, {"type": "or", "elements": tags}), c.param)


def text_format(kind: str, spec: Any) -> dict:
    """A response format as a structural tag's element (vLLM's structured_outputs_to_format)."""
    if kind in ("json_schema", "json_object"):
        return {"type": "json_schema", "json_schema": spec if kind == "json_schema" else {"type": "object"}}
    if kind == "regex":
        return {"type": "regex", "pattern": spec}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in spec]}
    if kind == "grammar":
        return {"type": "grammar", "grammar": spec}
    raise ConstraintError(f"unknown constraint kind {kind!r}", "response_format")


def _params(tool: dict, default: dict) -> dict:
    """A tool's parameters as vLLM's bare-JSON schemas take them: `default` when it has none."""
    params = tool.get("parameters")
    return params if isinstance(params, dict) and params else default


HARMONY_JSON_CONSTRAINS = (" json", " <|constrain|>json")
HARMONY_CALL_CHANNELS = ("<|channel|>commentary", "<|channel|>analysis", "<|channel|>final")
HARMONY_CALL_BEGINS = (" to=functions.{name}{channel}{constrain}<|message|>",
                       "{channel} to=functions.{name}{constrain}<|message|>")


def _args(tool: dict) -> dict:
    """A structural tag's arguments: the tool's parameters (any JSON when it has none), as vLLM pins them."""
    params = tool.get("parameters")
    return {"type": "json_schema", "json_schema": params if isinstance(params, dict) and params else True}


def _tag(begin: str, content: dict, end: str | list[str]) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _harmony(commentary: bool, content: dict) -> dict:
    """gpt-oss's reply under a grammar: an analysis message (reasoning) may come first, then (`commentary`) a
    commentary one, each followed by the next message's start, then `content`. Its stop tokens end a message as ""
    (xgrammar refuses stop tokens inside a grammar)."""
    def optional(channel: str) -> dict:
        return {"type": "optional", "content": {"type": "sequence", "elements": [
            _tag(f"<|channel|>{channel}<|message|>", {"type": "any_text"}, "<|end|>"),
            {"type": "const_string", "value": "<|start|>assistant"}]}}

    elements = [optional("analysis")] + ([optional("commentary")] if commentary else []) + [content]
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}


def _harmony_final(schema: dict) -> dict:
    finals = [_tag(f"<|channel|>final{constrain}<|message|>", {"type": "json_schema", "json_schema": schema},
                   ["<|end|>", ""]) for constrain in HARMONY_JSON_CONSTRAINS]
    return _harmony(False, {"type": "or", "elements": finals})
