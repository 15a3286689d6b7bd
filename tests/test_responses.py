"""The Responses API over chat completions (gateway/responses.py), with the real openai client against the real
built-in server: Response objects and stream events as OpenAI's, exact token ids, tool calls, refused inputs."""

import json
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from lightning_sdk import models

from .conftest import SERVED
from .responses_app import BREAK_MIDSTREAM, ResponsesApp

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is 2 + 3?"
RAG_QUESTION = "In which region was Rentissa born?"
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def app(server):
    a = ResponsesApp(server).start()
    yield a
    a.stop()


@pytest.fixture(scope="module")
def rag_app(tmp_path_factory):
    """The rag cookbook's tiny model, pretrained on Agents SDK conversations with a `search` tool: it calls it."""
    from lightning_sdk.servers.cpu import CPUServer

    model = models.resolve(f"tiny:{ROOT / 'cookbook' / 'rag' / 'teacher.py'}")
    srv = CPUServer(model, served_model_name="rag", threads=1, log_path=tmp_path_factory.mktemp("rag") / "log")
    srv.start()
    a = ResponsesApp(srv).start()
    yield a
    a.stop()
    srv.stop()


def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url, api_key=app.api_key, max_retries=0)


def post(app, body, **kw) -> httpx.Response:
    return httpx.post(f"{app.base_url}/responses", json=body, headers=app.auth, timeout=60, **kw)


def chat_ids(server, messages, **kw):
    """What a chat call to the server itself returns: prompt ids, completion ids, log-probs, text."""
    out = openai.OpenAI(base_url=server.base_url, api_key="EMPTY").chat.completions.create(
        model=SERVED, messages=messages, logprobs=True, extra_body={"return_token_ids": True}, **kw)
    choice = out.choices[0]
    return (out.model_extra["prompt_token_ids"], choice.model_extra["token_ids"],
            [t.logprob for t in choice.logprobs.content], choice.message.content, choice.finish_reason)


def sse_events(app, body) -> list[dict]:
    """The raw stream, each event validated as OpenAI's type."""
    events = []
    with httpx.stream("POST", f"{app.base_url}/responses", json={**body, "stream": True}, headers=app.auth,
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                EVENTS.validate_python(event)
                events.append(event)
    return events


def test_text_call_is_a_response_with_the_chat_calls_token_ids(app, server):
    raw = client(app).responses.with_raw_response.create(model="gpt-4o-mini", input=QUESTION, max_output_tokens=20,
                                                         extra_body={"seed": 11})
    body = json.loads(raw.text)
    r = Response.model_validate(body)  # the whole object, as OpenAI's type
    prompt, ids, logprobs, text, finish = chat_ids(server, [{"role": "user", "content": QUESTION}], max_tokens=20,
                                                   seed=11)
    assert body["prompt_token_ids"] == prompt and body["output_token_ids"] == ids
    assert body["output_logprobs"] == pytest.approx(logprobs) and len(ids) >= 1
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed" and finish == "stop"
    assert r.output_text == text and r.model == server.served_model_name and r.max_output_tokens == 20
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert r.usage.input_tokens == len(prompt) and r.usage.output_tokens == len(ids)
    assert r.usage.total_tokens == len(prompt) + len(ids)
    sent = app.chat_bodies[-1]  # what the backend was asked: token ids, log-probs, one choice
    assert sent["return_token_ids"] is True and sent["logprobs"] is True and sent["n"] == 1
    assert sent["max_tokens"] == 20 and sent["seed"] == 11


def test_instructions_and_message_items_become_chat_messages(app):
    r = client(app).responses.create(
        model="m", instructions="Be brief.", max_output_tokens=4,
        input=[{"role": "developer", "content": "Numbers only."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is "},
                                                               {"type": "input_text", "text": "1 + 1?"}]},
               {"type": "reasoning", "id": "rs_1", "summary": []}])
    assert r.status in ("completed", "incomplete")
    assert app.chat_bodies[-1]["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Numbers only."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "1 + 1?"}]}]


def test_fields_without_a_chat_meaning_are_ignored(app):
    r = post(app, {"model": "m", "input": QUESTION, "max_output_tokens": 2, "include": ["reasoning.encrypted_content"],
                   "reasoning": {"effort": "low"}, "truncation": "auto", "service_tier": "auto",
                   "metadata": {"run": "7"}, "text": {"format": {"type": "text"}, "verbosity": "low"},
                   "a_field_from_the_future": [1, 2]})
    assert r.status_code == 200, r.text
    assert Response.model_validate(r.json()).metadata == {"run": "7"}


def test_max_output_tokens_cut_is_incomplete(app):
    raw = client(app).responses.with_raw_response.create(model="m", input=QUESTION, max_output_tokens=1,
                                                         extra_body={"seed": 3})
    body = json.loads(raw.text)
    r = Response.model_validate(body)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and len(body["output_token_ids"]) == 1


def test_stream_is_openais_event_sequence_with_the_same_ids(app):
    request = {"model": "m", "input": QUESTION, "max_output_tokens": 20, "seed": 5}
    events = sse_events(app, request)
    kinds = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events))) and deltas
    final = events[-1]["response"]
    plain = post(app, request).json()
    assert final["output_token_ids"] == plain["output_token_ids"] and final["prompt_token_ids"] == plain[
        "prompt_token_ids"]
    assert final["output_logprobs"] == pytest.approx(plain["output_logprobs"])
    assert "".join(deltas) == events[-4]["text"] == Response.model_validate(final).output_text
    assert final["output"][0]["id"] == events[2]["item"]["id"] and events[0]["response"]["status"] == "in_progress"


def test_openai_client_streams_accept_the_events(app):
    c = client(app)
    events = list(c.responses.create(model="m", input=QUESTION, max_output_tokens=3, stream=True,
                                     extra_body={"seed": 2}))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert len(events[-1].response.model_extra["output_token_ids"]) == 3
    with c.responses.stream(model="m", input=QUESTION, max_output_tokens=20, extra_body={"seed": 2}) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text
    assert final.model_extra["output_token_ids"] == post(app, {"model": "m", "input": QUESTION,
                                                               "max_output_tokens": 20, "seed": 2}).json()[
        "output_token_ids"]


def test_previous_response_id_continues_the_conversation(app, server):
    c = client(app)
    first = c.responses.create(model="m", input=QUESTION, instructions="Old rules.", max_output_tokens=20)
    second = c.responses.create(model="m", input="What is 1 + 1?", previous_response_id=first.id,
                                max_output_tokens=20)
    conversation = [  # instructions are not carried over, as OpenAI's
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is 1 + 1?"}]
    assert app.chat_bodies[-1]["messages"] == conversation and second.previous_response_id == first.id
    assert second.model_extra["prompt_token_ids"] == chat_ids(server, conversation, max_tokens=1)[0]
    assert c.responses.retrieve(first.id).model_extra["output_token_ids"] == first.model_extra["output_token_ids"]
    unkept = c.responses.create(model="m", input=QUESTION, store=False, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", input="and then?", previous_response_id=unkept.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unkept.id)


def test_kept_responses_are_bounded(server):
    small = ResponsesApp(server, max_kept=1).start()
    try:
        c = client(small)
        first, second = (c.responses.create(model="m", input=QUESTION, max_output_tokens=2) for _ in range(2))
        with pytest.raises(openai.BadRequestError):  # the older one was let go
            c.responses.create(model="m", input="and?", previous_response_id=first.id, max_output_tokens=2)
        assert c.responses.create(model="m", input="and?", previous_response_id=second.id, max_output_tokens=2)
    finally:
        small.stop()


def test_backend_failure_mid_stream_is_an_error_event(app):
    events = sse_events(app, {"model": "m", "input": QUESTION, "max_output_tokens": 20, "user": BREAK_MIDSTREAM})
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "error" and "response.output_text.delta" in kinds and "response.completed" not in kinds
    assert events[-1]["message"] == "the engine died" and events[-1]["code"] == "500"
    streamed = list(client(app).responses.create(model="m", input=QUESTION, user=BREAK_MIDSTREAM, stream=True))
    assert streamed[-1].type == "error"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.name"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                             {"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.1.type"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input.0.type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"temperature": "hot"}, "temperature"),
    ({"input": 5}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"stream": "yes please"}, "stream"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),  # no schema
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"model": None}, "model"),
    ({"input": "x" * 2_000_000}, "input"),  # the backend's limit, named by the Responses field
])
def test_bad_requests_are_400_naming_the_field(app, body, param):
    r = post(app, {"model": "m", "input": QUESTION, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unreadable_bodies_are_400(app):
    lone = '{"model": "m", "input": "\\ud800"}'
    r = httpx.post(f"{app.base_url}/responses", content=lone, headers={"content-type": "application/json", **app.auth})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    for content in (b"{not json", b"[1, 2]"):
        r = httpx.post(f"{app.base_url}/responses", content=content, headers=app.auth)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    with pytest.raises(openai.BadRequestError):  # as the openai client sees it
        client(app).responses.create(model="m", input=QUESTION, tools=[{"type": "web_search"}])


def test_backend_errors_pass_through_with_their_status(app):
    r = post(app, {"model": "m", "input": QUESTION, "tool_choice": "required"})  # the server's own check
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_tool_calls_are_function_call_items(rag_app):
    c = client(rag_app)
    tools = [{"type": "function", "name": "search", "description": "Search the encyclopedia; returns the best "
              "matching passages.", "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                   "required": ["query"]}}]
    request = {"model": "m", "input": RAG_QUESTION, "tools": tools, "temperature": 0,
               "instructions": "Answer with the region name only. Search for the person, then for their town's "
                               "region."}
    raw = c.responses.with_raw_response.create(**request)
    r = Response.model_validate(json.loads(raw.text))
    (call,) = r.output
    assert call.type == "function_call" and call.name == "search" and call.status == "completed"
    assert json.loads(call.arguments) == {"query": "Rentissa"} and call.call_id.startswith("call_")
    assert rag_app.chat_bodies[-1]["tools"] == [{"type": "function", "function": {k: v for k, v in tools[0].items()
                                                                                  if k != "type"}}]

    # The call's output goes back as the next input: an assistant tool call and a tool message, same call id.
    c.responses.create(**{**request, "input": [{"role": "user", "content": RAG_QUESTION}, call.model_dump(),
                                               {"type": "function_call_output", "call_id": call.call_id,
                                                "output": "Rentissa was born in the town of Lomimi."}]})
    assert rag_app.chat_bodies[-1]["messages"][1:] == [
        {"role": "user", "content": RAG_QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "search", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Rentissa was born in the town of Lomimi."}]

    events = sse_events(rag_app, request)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * (len(kinds) - 6),
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[2]["item"]["type"] == "function_call"
    assert "".join(e["delta"] for e in events if e["type"].endswith("arguments.delta")) == call.arguments
    assert events[-1]["response"]["output"][0]["arguments"] == call.arguments
    assert events[-1]["response"]["output_token_ids"] == json.loads(raw.text)["output_token_ids"]


def test_unknown_response_is_404(app):
    r = httpx.get(f"{app.base_url}/responses/resp_nope", headers=app.auth)
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
