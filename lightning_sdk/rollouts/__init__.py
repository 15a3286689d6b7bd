"""Running the agent: one rollout (`episode`, of a `job`), and the strategies that run a phase of them
(`collector`: `embedded` in this process, `ray` on Ray actors, `remote` through `lightning worker` processes)."""
