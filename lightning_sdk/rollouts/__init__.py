"""Running the agent: one rollout (`worker`), and the strategies that run a phase of them (`collector`:
`embedded` in this process, `ray` on Ray actors)."""
