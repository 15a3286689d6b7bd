"""The gateway: the one OpenAI-compatible address every agent calls in a run (`proxy`), the Responses API over
chat completions (`responses`), the training record of each call it serves (`capture`, `record`), and the
limits and keys of every server of the run (`guard`, `listen`). Importing the package imports none of them."""
