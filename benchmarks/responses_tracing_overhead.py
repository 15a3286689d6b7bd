"""What tracing a Responses API call costs the agent's thread, against a chat call's span (the reference).

    python benchmarks/responses_tracing_overhead.py --calls 2000

No server: each client replays a canned reply (a Response with token ids from gateway/responses.py's shape, a
chat completion with vLLM's token-id fields) through an in-process transport, so the numbers are the client-side
cost only. For each API, untraced calls (the original method, saved before instrumentation) and traced calls
(inside a rollout context: span, token-id request, deferred attributes) alternate; the calling thread's CPU time
is measured. Prints the extra calling-thread CPU per span for each API and `ratio=<responses/chat>` last.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import openai
from openai.resources.chat.completions import Completions
from openai.resources.responses import Responses

from lightning_sdk import tracing
from lightning_sdk.store import Store

p = argparse.ArgumentParser()
p.add_argument("--calls", type=int, default=2000, help="calls of each kind")
p.add_argument("--warmup", type=int, default=100)
args = p.parse_args()

PROMPT, OUT, LPS = list(range(1, 40)), [288, 269, 298, 2], [-1.4, -0.01, -0.08, -0.001]
RESPONSE = {
    "id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "model": "m",
    "output": [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": "It is 5", "annotations": [], "logprobs": []}]}],
    "usage": {"input_tokens": 39, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
              "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 43},
    "tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "metadata": {},
    "prompt_token_ids": PROMPT, "output_token_ids": OUT, "output_logprobs": LPS,
}
CHAT = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "prompt_token_ids": PROMPT,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "It is 5"}, "finish_reason": "stop",
                 "token_ids": OUT, "logprobs": {"content": [{"token": "x", "logprob": lp, "bytes": [120],
                                                             "top_logprobs": []} for lp in LPS]}}],
    "usage": {"prompt_tokens": 39, "completion_tokens": 4, "total_tokens": 43,
              "prompt_tokens_details": {"cached_tokens": 0}},
}


def canned(reply: dict) -> openai.OpenAI:
    import httpx2

    return openai.OpenAI(base_url="http://canned.invalid/v1", api_key="EMPTY", max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(
                             lambda request: httpx2.Response(200, json=reply))))


plain_responses, plain_chat = Responses.create, Completions.create  # before tracing.install wraps them
tmp = Path(tempfile.mkdtemp(prefix="ls-resp-bench-"))
store = Store(tmp / "store.sqlite")
tracing.install(store)
tracing.request_token_ids_from("http://canned.invalid/v1")
responses_client, chat_client = canned(RESPONSE), canned(CHAT)
kinds = {
    "responses": (lambda: plain_responses(responses_client.responses, model="m", input="What is 2 + 3?"),
                  lambda: responses_client.responses.create(model="m", input="What is 2 + 3?")),
    "chat": (lambda: plain_chat(chat_client.chat.completions, model="m",
                                messages=[{"role": "user", "content": "What is 2 + 3?"}]),
             lambda: chat_client.chat.completions.create(model="m",
                                                         messages=[{"role": "user", "content": "What is 2 + 3?"}])),
}
extra = {}
for kind, (untraced, traced) in kinds.items():
    cpu = {False: [], True: []}
    for i in range(args.calls + args.warmup):
        for is_traced in ((False, True) if i % 2 else (True, False)):
            c0 = time.thread_time()
            if is_traced:
                with tracing.rollout_context(f"{kind}-{i}"):
                    traced()
            else:
                untraced()
            if i >= args.warmup:
                cpu[is_traced].append(time.thread_time() - c0)
    tracing.flush()
    extra[kind] = statistics.mean(cpu[True]) - statistics.mean(cpu[False])
    print(f"{kind}: untraced {statistics.mean(cpu[False]) * 1e6:.0f} us, traced {statistics.mean(cpu[True]) * 1e6:.0f}"
          f" us calling-thread CPU per call: +{extra[kind] * 1e6:.0f} us per span")
spans = store.count("spans")
store.close()
print(f"spans stored: {spans}, writer errors: {tracing.writer_errors()}")
print(f"ratio={extra['responses'] / extra['chat']:.3f}")
