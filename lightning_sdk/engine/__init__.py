"""The built-in inference server (CPU, transformers): the OpenAI-compatible app (`app`), the engine that batches
and samples (`engine`, `scheduler`, `batch`, `sampling`, `requests`) and tool-call parsing (`toolcalls`). It runs
in its own process: `python -m lightning_sdk.engine`."""
