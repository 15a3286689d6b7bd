"""The update phase: GRPO math (`grpo`), micro-batching (`microbatch`), the LoRA/QLoRA trainer (`trainer`) and the
run's checkpoints (`checkpoint`). torch is imported here, never on the agent's side."""
