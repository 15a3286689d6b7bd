"""Grammar compilation under attack (issue 52, item 5): a constraint over a size limit is refused at once with a 400
naming the field and the limit; compiles run on threads of their own, so another client's plain chat is answered
promptly while schemas compile; a compile past its deadline is refused and discarded, compiles in flight are
bounded, and the compiled-grammar cache is bounded by bytes. A real server on 127.0.0.1 (the tiny model) and real
xgrammar compiles. The issue asks for time bounds here: each is generous (10x or more the expected time)."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from lightning_sdk import constraint, grammar, models
from lightning_sdk.constraint import Constraint, ConstraintError
from lightning_sdk.grammar import Grammars
from lightning_sdk.servers.cpu import CPUServer

KEY = "grammar-key"
NAME = "policy"
AUTH = {"Authorization": f"Bearer {KEY}"}
PLAIN = {"model": NAME, "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 2}
PARAM = "response_format.json_schema.schema"


@pytest.fixture(scope="module")
def server():
    with CPUServer("builtin:tiny-arith", served_model_name=NAME, api_key=KEY, threads=1, max_model_len=128,
                   max_batch_size=8) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer():
    return models.load_tokenizer(models.resolve("builtin:tiny-arith"))


def optional_properties(n: int, tag: str) -> dict:
    """An object of n optional properties: within the limits, and among the slowest such schemas to compile."""
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(n)}}


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def chat_seconds(c: httpx.Client) -> float:
    t0 = time.perf_counter()
    r = c.post("/v1/chat/completions", json=PLAIN, headers=AUTH)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def test_a_plain_chat_is_answered_promptly_while_8_schemas_compile(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        chat_seconds(c)  # warm
        alone = statistics.median(chat_seconds(c) for _ in range(5))
        answers: list[int] = []

        def constrained(k: int) -> None:
            body = {**PLAIN, "response_format": schema_format(optional_properties(900, f"s{k}_"))}
            with httpx.Client(base_url=server.url, timeout=120) as own:
                answers.append(own.post("/v1/chat/completions", json=body, headers=AUTH).status_code)

        threads = [threading.Thread(target=constrained, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the compiles are under way
        during = [chat_seconds(c) for _ in range(3)]
        for t in threads:
            t.join()
    # On the default executor the chat's encoding queued behind the compiles (seconds, whatever `alone` is); on
    # threads of their own it shares only the CPU with them.
    print(f"plain chat alone {alone:.3f} s, while 8 schemas compile {max(during):.3f} s")
    assert max(during) < 1.5 + 10 * alone, (alone, during)
    # every schema was answered: compiled (200) or, while the compile threads were busy, 503; never an error
    assert len(answers) == 8 and set(answers) <= {200, 503} and 200 in answers, answers


@pytest.mark.parametrize("what, fields, param, limit", [
    ("arrays nested 900 deep", {"response_format": schema_format(nested_arrays(900))}, PARAM, "MAX_NESTING_DEPTH"),
    ("a 20,000-value enum", {"response_format": schema_format({"enum": [f"v{i}" for i in range(20000)]})}, PARAM,
     "MAX_ENUM_VALUES"),
    ("20,000 choices", {"structured_outputs": {"choice": [f"c{i}" for i in range(20000)]}},
     "structured_outputs.choice", "MAX_ENUM_VALUES"),
    ("a 5,000-rule grammar", {"structured_outputs": {"grammar": "root ::= r0\n" + "\n".join(
        f'r{i} ::= "x" | r{i + 1}' for i in range(5000)) + '\nr5000 ::= "y"'}}, "structured_outputs.grammar",
     "MAX_GRAMMAR_RULES"),
    ("a 2,000-property object", {"response_format": schema_format(optional_properties(2000, "p"))}, PARAM,
     "MAX_PROPERTIES"),
    # xgrammar expands a schema pattern's repetitions (this one compiled for seconds); a regex's or a grammar's it
    # does not, but they are bounded alike: the gateway checks them for vLLM, whose other backends may expand them
    ("a pattern of nested repetitions", {"response_format": schema_format(
        {"type": "string", "pattern": "((a{0,30}){0,30}){0,30}"})}, PARAM, "MAX_REPETITION"),
    ("repetitions over many patterns", {"response_format": schema_format({"type": "object", "properties": {
        k: {"type": "string", "pattern": f"{k}{{0, 400}}"} for k in "abc"}})}, PARAM, "MAX_REPETITION"),
    ("a regex of nested repetitions", {"structured_outputs": {"regex": "((a{0,30}){0,30}){0,30}"}},
     "structured_outputs.regex", "MAX_REPETITION"),
    ("a grammar of nested repetitions", {"structured_outputs": {"grammar": 'root ::= ("a"{0,100}){0,100}'}},
     "structured_outputs.grammar", "MAX_REPETITION"),
    ("a forced tool's pattern", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "x{5000}"}}}}}],
        "tool_choice": "required"}, "tool_choice", "MAX_REPETITION"),
    # tools offered beside a response format: one reply, one budget for both (each alone is under it)
    ("a tool's pattern and the format's", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "x{600}"}}}}}],
        "response_format": schema_format({"type": "string", "pattern": "y{600}"})}, PARAM, "MAX_REPETITION"),
])
def test_a_constraint_over_a_limit_gets_a_400_naming_it_at_once(server, what, fields, param, limit):
    with httpx.Client(base_url=server.url, timeout=10) as c:  # these compiled for seconds to minutes before
        t0 = time.perf_counter()
        r = c.post("/v1/chat/completions", json={**PLAIN, **fields}, headers=AUTH)
        took = time.perf_counter() - t0
        assert r.status_code == 400, (what, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == param and err["message"].startswith(param), err
        assert f"this server's limit of {getattr(constraint, limit)}" in err["message"], err
        assert took < 5, (what, took)
        chat_seconds(c)  # and it still serves


def test_a_compile_past_its_deadline_is_refused_discarded_and_compiles_in_flight_are_bounded(tokenizer):
    g = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], deadline_s=0.3, in_flight=1)
    slow = Constraint("json_schema", optional_properties(900, "d"), PARAM)
    t0 = time.perf_counter()
    with pytest.raises(ConstraintError, match="did not compile within this server's limit of 0.3 s") as e:
        g.compile(slow)
    assert not isinstance(e.value, grammar.GrammarBusy) and e.value.param == PARAM and time.perf_counter() - t0 < 3
    # the slow compile still holds the only slot: a second constraint is refused at once, as busy (an HTTP 503)
    with pytest.raises(grammar.GrammarBusy, match="limit of 1 grammar compiles in flight"):
        g.compile(Constraint("regex", "[0-9]+", "structured_outputs.regex"))
    deadline = time.monotonic() + 60
    while g.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert g.running == 0 and g.cached == 0  # it finished late and was discarded, the slot is free again
    t0 = time.perf_counter()  # asked again, it is refused at once and starts no second compile
    with pytest.raises(ConstraintError, match="did not compile within this server's limit of 0.3 s") as e:
        g.compile(slow)
    assert not isinstance(e.value, grammar.GrammarBusy) and g.running == 0 and time.perf_counter() - t0 < 0.5
    assert g.compile(Constraint("regex", "[0-9]+", "structured_outputs.regex")) is not None
    g.close()


def test_the_compiled_grammar_cache_is_bounded_by_bytes(tokenizer):
    limit = 3 * 2**20
    g = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_bytes=limit)
    sizes = []
    for k in range(8):  # each ~0.7 MiB by xgrammar's estimate: 8 of them do not fit in 3 MiB
        c = Constraint("json_schema", optional_properties(200, f"k{k}_"), PARAM)
        sizes.append(g.compile(c).memory_size_bytes + len(c.to_json()))
        assert g.cache_bytes <= limit
    assert g.cache_bytes == sum(sizes[-g.cached:]) and 0 < g.cached < 8  # the least recently used went first
    g.close()


def test_the_gateway_refuses_a_constraint_over_a_limit_before_any_backend():
    """Every backend (vLLM compiles its own grammars, and the trainer replays each recorded one): the gateway refuses
    at once, for chat, completions and Responses alike. Its backend is a closed port, so a 400 (not a 502) is the
    gateway's own answer."""
    from lightning_sdk.gateway.proxy import Gateway
    from lightning_sdk.gateway.listen import bind

    dead = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()  # nothing listens there: a request that reached it would be a 502
    g = Gateway(api_key="agents")
    g.start([url], backend_key="x")
    g.policy = NAME
    try:
        deep = schema_format(nested_arrays(900))
        with httpx.Client(base_url=g.url, timeout=10, headers={"Authorization": "Bearer agents"}) as c:
            for route, body in (("/v1/chat/completions", {**PLAIN, "response_format": deep}),
                                ("/v1/completions", {"model": NAME, "prompt": "2+2=", "max_tokens": 2,
                                                     "response_format": deep}),
                                ("/v1/responses", {"model": NAME, "input": "2+2=", "text": {"format": {
                                    "type": "json_schema", "name": "x", "schema": nested_arrays(900)}}})):
                r = c.post(route, json=body)
                assert r.status_code == 400, (route, r.status_code, r.text[:300])
                assert f"this server's limit of {constraint.MAX_NESTING_DEPTH}" in r.json()["error"]["message"]
            r = c.post("/v1/chat/completions", json=PLAIN)
            assert r.status_code == 502, r.text  # and a plain request does reach for the backend
    finally:
        g.stop()
