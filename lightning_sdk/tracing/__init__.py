"""The agent side of a run's observability: which rollout and role an LLM call belongs to, and the spans an
episode leaves behind (tools, framework steps, rewards). The training record of each LLM call is not made here:
the gateway makes it (gateway/capture.py).

One idea per module:
- `context`: the rollout context, `component`, `emit_reward` (OpenTelemetry API only);
- `propagation`: the rollout's context on every request toward the gateway (W3C traceparent and baggage);
- `records`: the span record the store keeps, our attribute names, the sink protocols;
- `writer`: the span processor and its writer thread;
- `instrument`: `install`, turning the above on in a process;
- `export`: spans to an OTLP/HTTP collector and to the application's own TracerProvider.
"""

from lightning_sdk.tracing.context import (RolloutContext, component, current_component, current_rollout,
                                           emit_reward, rollout_context)
from lightning_sdk.tracing.instrument import export_errors, export_received, flush, install, writer_errors
from lightning_sdk.tracing.records import (ATTEMPT, COMPLETION_IDS, COMPLETION_LOGPROBS, COMPONENT, PROMPT_IDS,
                                           REWARD_NAME, REWARD_SPAN, REWARD_VALUE, ROLLOUT_ID, TRACER_NAME,
                                           SpanRecord, SpanSink, is_llm_call, to_record)
from lightning_sdk.tracing.writer import StoreSpanProcessor

__all__ = [
    "ATTEMPT", "COMPLETION_IDS", "COMPLETION_LOGPROBS", "COMPONENT", "PROMPT_IDS", "REWARD_NAME", "REWARD_SPAN",
    "REWARD_VALUE", "ROLLOUT_ID", "TRACER_NAME", "RolloutContext", "SpanRecord", "SpanSink", "StoreSpanProcessor",
    "component", "current_component", "current_rollout", "emit_reward", "export_errors", "export_received", "flush",
    "install", "is_llm_call", "rollout_context", "to_record", "writer_errors",
]
