"""Serving the policy to a deployed app (`lightning serve`): the run's backend and gateway, every call recorded,
calls grouped into episodes by their trace id, and rewards that arrive late, by reference (docs/serve.md)."""
