"""What an agent's episode leaves behind: OpenTelemetry spans, tagged with their rollout, sent to a store.

One idea per module:
- `context`: the agent side — rollout context, `component`, `emit_reward` (OpenTelemetry API only);
- `records`: the span record the store keeps, our attribute names, the sink protocol;
- `writer`: the span processor and its writer thread;
- `token_ids`: exact token ids and log-probs from the server's response onto the span;
- `responses`: spans for OpenAI Responses API calls, with their token ids (instead of the instrumentor's);
- `instrument`: `install`, instrumenting the OpenAI client once per process and routing spans to a sink;
- `deferred`: attribute work the agent's thread leaves to the writer thread;
- `calls`: a call made on the agent's thread and traced through the instrumentor on the writer thread;
- `recorded`: spans recorded on the agent's thread and built on the writer thread;
- `export`: spans to an OTLP/HTTP collector and to the application's own TracerProvider.
"""

from lightning_sdk.tracing.context import (RolloutContext, component, current_component, current_rollout,
                                           emit_reward, rollout_context)
from lightning_sdk.tracing.instrument import export_errors, export_received, flush, install, writer_errors
from lightning_sdk.tracing.records import (ATTEMPT, COMPLETION_IDS, COMPLETION_LOGPROBS, COMPONENT, PROMPT_IDS,
                                           REWARD_NAME, REWARD_SPAN, REWARD_VALUE, ROLLOUT_ID, TRACER_NAME,
                                           SpanRecord, SpanSink, to_record)
from lightning_sdk.tracing.token_ids import request_token_ids_from
from lightning_sdk.tracing.writer import StoreSpanProcessor

__all__ = [
    "ATTEMPT", "COMPLETION_IDS", "COMPLETION_LOGPROBS", "COMPONENT", "PROMPT_IDS", "REWARD_NAME", "REWARD_SPAN",
    "REWARD_VALUE", "ROLLOUT_ID", "TRACER_NAME", "RolloutContext", "SpanRecord", "SpanSink", "StoreSpanProcessor",
    "component", "current_component", "current_rollout", "emit_reward", "export_errors", "export_received", "flush",
    "install", "request_token_ids_from", "rollout_context", "to_record", "writer_errors",
]
