"""The update phase: GRPO math (`grpo`), micro-batching (`batch`), the LoRA/QLoRA trainer (`trainer`) and the
run's checkpoints (`checkpoint`). torch is imported here, never on the agent's side."""
