"""The memory a run needs, on paper: pure functions of a model's shape and the run's settings, no model loaded.

What one device holds (docs/scaling.md, "Memory on one device", is this module's table):
- the trainer's base weights: bf16/fp32 as loaded, or nf4 (`model.quantization = "4bit"`: bitsandbytes' 4-bit
  codes, one 8-bit scale per block of 64 and one fp32 scale per 256 of those, double quantization), the tensors nf4
  leaves alone (embeddings, the head, norms, biases) in fp32 as models.load_causal_lm keeps them;
- the LoRA adapters: fp32 weights, their gradients and AdamW's two moments (16 bytes a parameter);
- the activations of one micro-batch (train.micro_batch_size rows of up to the context each): bytes per token per
  decoder layer, linear in the tokens (the attention reads no L x L mask), with gradient checkpointing the layer's
  input only plus one layer recomputed at a time. The constants are measured (benchmarks/activation_bytes.py);
- the LM head's logits, only at the trained tokens (train/head.py), in fp32 with their log-softmax and its gradient
  (measured: 16 bytes a logit);
- the inference server beside it: vLLM takes serve.gpu_memory_utilization of the GPU while awake (bf16 weights,
  LoRA slots, its runtime, the rest KV cache: 2 x layers x kv_heads x head_dim x 2 bytes a token) and keeps only
  its runtime during an update with serve.sleep_level = 1; the built-in server holds the base as the trainer does.

A run is two phases on a shared device: collection (server awake, trainer resident) and the update (server asleep
or not, trainer resident plus activations); it needs the larger of the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

GB = 1e9  # the unit GPUs are sold in (a "24 GB" card); the table and the warning speak it
GiB = 2**30

# Per decoder layer, bytes of activations per token = c_h x hidden_size + c_i x intermediate_size, by (dtype,
# gradient checkpointing): least squares over qwen2.5-0.5b, qwen2.5-1.5b and llama-3.2-1b shapes, LoRA all-linear
# r 16, sdpa, one row without mask (benchmarks/activation_bytes.py prints the fit and these beside it).
ACTIVATION: dict[tuple[str, bool], tuple[float, float]] = {
    ("float32", False): (27.7, 15.6),
    ("float32", True): (4.0, 0.0),
    ("bfloat16", False): (39.3, 10.0),
    ("bfloat16", True): (1.2, 0.0),
}
# Bytes per token per unit of hidden_size outside the layers (the embeddings' output, the final norm, the hidden
# states' gradient; with checkpointing also what the recomputed layer holds beyond its own activations): the same
# fit's remainder.
OUTSIDE: dict[tuple[str, bool], float] = {("float32", False): 42.6, ("float32", True): 43.2,
                                          ("bfloat16", False): 38.8, ("bfloat16", True): 53.4}
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # a 4-bit code + its block's 8-bit scale + the scales' fp32 scale
LORA_BYTES = 16  # fp32 weight + fp32 gradient + AdamW's exp_avg and exp_avg_sq
# The LM head's peak per logit (trained token x vocabulary entry): the logits, their fp32 copy over the temperature,
# the log-softmax and its gradient; the same in fp32 and bf16 (benchmarks/activation_bytes.py --head)
HEAD_LOGIT_BYTES = 16
TRAINED_SHARE = 0.25  # the trained (completion) share of a row's tokens the table and the warning assume
CUDA_CONTEXT = 0.5 * GiB  # a CUDA process's context before any tensor (each process on a GPU)
VLLM_RUNTIME = 2.0 * GiB  # vLLM's own beyond weights and KV: the profiling pass's activations, CUDA graphs
VLLM_ASLEEP = 1.0 * GiB  # what a sleeping vLLM (level 1) keeps on the GPU: its context and allocator pools
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the budget reads of a decoder-only transformer (Llama, Qwen2/3, Mistral and their kin)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    context: int  # max_position_embeddings
    qkv_bias: bool = False
    qk_norm: bool = False
    dtype: str = "bfloat16"  # the checkpoint's

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """From a transformers configuration (or anything with its attribute names)."""
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(c.num_attention_heads)
        dtype = str(getattr(c, "dtype", None) or getattr(c, "torch_dtype", None) or "bfloat16")
        dtype = dtype.removeprefix("torch.")
        model_type = getattr(c, "model_type", "")
        return cls(layers=int(c.num_hidden_layers), hidden=int(c.hidden_size), intermediate=int(c.intermediate_size),
                   heads=heads, kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads), vocab=int(c.vocab_size),
                   tied=bool(getattr(c, "tie_word_embeddings", False)),
                   context=int(getattr(c, "max_position_embeddings", 0) or 0),
                   qkv_bias=model_type == "qwen2" or bool(getattr(c, "attention_bias", False)),
                   qk_norm=model_type == "qwen3", dtype=dtype if dtype in DTYPE_BYTES else "bfloat16")

    def linears(self) -> dict[str, tuple[int, int]]:
        """Each decoder layer's linear layers, (in, out) features."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                "up_proj": (h, i), "down_proj": (i, h)}

    def linear_parameters(self) -> int:
        """The decoder layers' linear weights (what nf4 quantizes), all layers."""
        return self.layers * sum(a * b for a, b in self.linears().values())

    def other_parameters(self) -> int:
        """Every parameter nf4 leaves alone: embeddings, the head (untied), norms, biases."""
        per_layer = 2 * self.hidden + (self.heads + 2 * self.kv_heads) * self.head_dim * self.qkv_bias \
            + 2 * self.head_dim * self.qk_norm
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden + self.layers * per_layer

    def parameters(self) -> int:
        return self.linear_parameters() + self.other_parameters()

    def lora_parameters(self, r: int, targets: str | tuple[str, ...] = "all-linear") -> int:
        """One adapter of rank r on `targets` ("all-linear": every decoder linear; "lm_head" adds the head)."""
        names = set(LINEARS) if targets == "all-linear" else set(targets) | (set(LINEARS) if "all-linear" in targets
                                                                              else set())
        n = self.layers * sum(r * (a + b) for name, (a, b) in self.linears().items() if name in names)
        return n + (r * (self.hidden + self.vocab) if "lm_head" in names else 0)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """vLLM's KV cache per token: keys and values of every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class Setup:
    """The settings the budget depends on, named as the config names them."""

    context: int  # tokens of the longest row (serve.max_model_len, or the model's context)
    rows: int = 1  # train.micro_batch_size
    dtype: str = "bfloat16"  # the trainer's compute dtype (model.dtype resolved)
    quantization: str = "none"  # model.quantization
    lora_r: int = 16
    targets: str | tuple[str, ...] = "all-linear"
    adapters: int = 1  # [policies]: one adapter and optimizer each
    checkpointing: bool = False  # train.gradient_checkpointing
    server: str = "vllm"  # on the trainer's device: "vllm", "builtin" (the built-in server), "none" (elsewhere)
    gpu_memory_utilization: float = 0.5
    sleep_level: int = 1
    max_loras: int = 2
    gpu: bool = True  # a CUDA device (each process then holds a CUDA context)
    trained_share: float = TRAINED_SHARE


@dataclass(frozen=True)
class Budget:
    """Line items in bytes, the phase totals and whether they fit `device` bytes."""

    items: dict[str, float]
    collect: float  # server awake + trainer resident
    update: float  # server asleep (or not) + trainer resident + activations + LM head
    device: float
    kv_tokens: float | None = None  # vLLM: tokens its KV cache holds at serve.gpu_memory_utilization
    notes: list[str] = field(default_factory=list)

    @property
    def need(self) -> float:
        return max(self.collect, self.update)

    @property
    def fits(self) -> bool:
        return self.need <= self.device and not self.notes


def weight_bytes(shape: ModelShape, dtype: str, quantization: str) -> float:
    if quantization == "4bit":
        return shape.linear_parameters() * NF4_BYTES + shape.other_parameters() * 4
    return shape.parameters() * DTYPE_BYTES[dtype]


def activation_bytes(shape: ModelShape, tokens: int, dtype: str, checkpointing: bool) -> float:
    """One micro-batch's activations for `tokens` tokens (rows x their length) through every decoder layer."""
    key = "float32" if dtype == "float32" else "bfloat16"
    per_layer = _per_layer(shape, key, checkpointing)
    recomputed = _per_layer(shape, key, False) if checkpointing else 0.0  # one layer at a time, in the backward
    return tokens * (shape.layers * per_layer + recomputed + OUTSIDE[(key, checkpointing)] * shape.hidden)


def _per_layer(shape: ModelShape, key: str, checkpointing: bool) -> float:
    ch, ci = ACTIVATION[(key, checkpointing)]
    return ch * shape.hidden + ci * shape.intermediate


def head_bytes(shape: ModelShape, trained: int) -> float:
    """The LM head's logits at `trained` tokens, through the fp32 log-softmax and back."""
    return trained * shape.vocab * HEAD_LOGIT_BYTES


def budget(shape: ModelShape, s: Setup, device: float) -> Budget:
    """What the run `s` on `shape` needs of one device of `device` bytes."""
    bytes_ = DTYPE_BYTES[s.dtype]
    tokens = s.rows * s.context
    items = {
        "weights": weight_bytes(shape, s.dtype, s.quantization),
        "LoRA + AdamW": s.adapters * shape.lora_parameters(s.lora_r, s.targets) * LORA_BYTES,
        "activations": activation_bytes(shape, tokens, s.dtype, s.checkpointing),
        "LM head": head_bytes(shape, math.ceil(tokens * s.trained_share)),
    }
    if s.gpu:
        items["CUDA context"] = CUDA_CONTEXT
    resident = items["weights"] + items["LoRA + AdamW"] + items.get("CUDA context", 0.0)
    notes = []
    kv_tokens = None
    if s.server == "vllm":
        awake = s.gpu_memory_utilization * device
        items["vLLM awake"] = awake
        items["vLLM asleep"] = VLLM_ASLEEP if s.sleep_level else awake
        # vLLM serves the bf16 base whatever the trainer holds, plus max_loras adapter slots in bf16
        held = shape.parameters() * 2 + s.max_loras * shape.lora_parameters(s.lora_r, s.targets) * 2 + VLLM_RUNTIME
        kv_tokens = max(0.0, (awake - held) / shape.kv_bytes_per_token())
        items["KV cache / token"] = shape.kv_bytes_per_token()
        if kv_tokens < s.context:
            notes.append(f"vLLM's KV cache holds {kv_tokens:,.0f} tokens at serve.gpu_memory_utilization = "
                         f"{s.gpu_memory_utilization:g}, fewer than one {s.context}-token call")
        collect, asleep = resident + awake, items["vLLM asleep"]
    elif s.server == "builtin":
        # The built-in server holds the base as the trainer does; its KV cache lives only while it answers.
        server = items["weights"] + (CUDA_CONTEXT if s.gpu else 0.0)
        items["server"] = server
        kv = s.context * shape.kv_bytes_per_token(bytes_)
        items["server KV (1 call)"] = kv
        collect, asleep = resident + server + kv, server
    else:
        collect, asleep = resident, 0.0
    update = resident + asleep + items["activations"] + items["LM head"]
    return Budget(items, collect, update, device, kv_tokens, notes)


def fix(shape: ModelShape, s: Setup, device: float) -> tuple[Setup, list[str]] | None:
    """The settings that make `s` fit `device` and the `key = value` of each change, or None when none of these
    does. Tried in the order a user would give things up: fewer rows a pass (the same update in more passes; as
    many as fit, with gradient checkpointing where that lets more fit: it costs compute only), then 4-bit weights
    (QLoRA: the base the trainer scores drifts from the one vLLM serves), then vLLM's share of the GPU, then the
    built-in server on the GPU instead of vLLM (it holds the trainer's nf4 base, but generates far slower), last a
    shorter context (it cuts calls off)."""
    if budget(shape, s, device).fits:
        return s, []
    contexts = [s.context] + [c for c in (16384, 8192, 4096, 2048, 1024) if c < s.context]
    servers = [s.server] + (["builtin"] if s.server == "vllm" else [])
    quants = [s.quantization] + (["4bit"] if s.quantization == "none" and s.dtype != "float32" else [])
    rows = [s.rows] + [r for r in (32, 16, 8, 4, 2, 1) if r < s.rows]
    for context in contexts:
        for server in servers:
            for quantization in quants:
                base = replace(s, context=context, server=server, quantization=quantization)
                shares = [base] + ([_vllm_share(shape, base, device)] if server == "vllm" else [])
                for share in shares:
                    for r in rows:
                        for checkpointing in dict.fromkeys((s.checkpointing, True)):
                            t = replace(share, rows=r, checkpointing=checkpointing)
                            if budget(shape, t, device).fits:
                                return t, _changes(s, t)
    return None


def _changes(was: Setup, now: Setup) -> list[str]:
    said = []
    if now.checkpointing != was.checkpointing:
        said.append("train.gradient_checkpointing = true")
    if now.rows != was.rows:
        said.append(f"train.micro_batch_size = {now.rows}")
    if now.quantization != was.quantization:
        said.append(f"model.quantization = '{now.quantization}'")
    if now.server != was.server:
        said.append("serve.backend = 'cpu' and serve.device = 'cuda' (the built-in server on the GPU)")
    if now.gpu_memory_utilization != was.gpu_memory_utilization:
        said.append(f"serve.gpu_memory_utilization = {now.gpu_memory_utilization:g}")
    if now.context != was.context:
        said.append(f"serve.max_model_len = {now.context}")
    return said


def _vllm_share(shape: ModelShape, s: Setup, device: float, calls: int = 8) -> Setup:
    """serve.gpu_memory_utilization (a multiple of 0.05) that leaves vLLM KV room for `calls` calls of the full
    context, or as many as the trainer's resident state leaves room for (one at least, where it can)."""
    held = shape.parameters() * 2 + s.max_loras * shape.lora_parameters(s.lora_r, s.targets) * 2 + VLLM_RUNTIME
    b = budget(shape, s, device)
    room = 1 - (b.items["weights"] + b.items["LoRA + AdamW"] + b.items.get("CUDA context", 0.0)) / device
    for n in (calls, 1):
        want = math.ceil((held + n * s.context * shape.kv_bytes_per_token()) / device * 20) / 20
        if want <= room:
            return replace(s, gpu_memory_utilization=round(want, 2))
    return replace(s, gpu_memory_utilization=round(max(0.05, math.floor(room * 20) / 20), 2))


def gb(x: float) -> str:
    return f"{x / GB:.1f}"


# ---------------------------------------------------------------------------------------------- docs/scaling.md
CASES = (("qwen2.5-1.5b", "Qwen2.5-1.5B"), ("qwen2.5-7b", "Qwen2.5-7B"))
CONTEXTS = (8192, 16384)
DEVICES = ((24, "24 GB"), (80, "80 GB"))


def table() -> str:
    """docs/scaling.md's memory table (markdown): each case at the project's defaults, then as `fix` picks."""
    from lightning_sdk.config import ServeConfig, TrainConfig
    from lightning_sdk.models import shapes

    t, v = TrainConfig(), ServeConfig()
    default = dict(rows=t.micro_batch_size, checkpointing=t.gradient_checkpointing, lora_r=t.lora_r,
                   gpu_memory_utilization=v.gpu_memory_utilization, sleep_level=v.sleep_level,
                   max_loras=v.max_loras)
    out = ["| model | context | GPU | settings | weights | LoRA + AdamW | activations a row: ckpt off / on | "
           "LM head a row | server awake / during the update | KV cache: a call / calls held | update | collect | "
           "fits |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for family, label in CASES:
        shape = ModelShape.of(shapes.config(f"shape:{family}"))
        for context in CONTEXTS:
            for size, device_label in DEVICES:
                device = size * GB
                s = Setup(context=context, **default)
                picked = fix(shape, s, device)
                cases = [("defaults", s)] + ([("picked", picked[0])] if picked and picked[1] else [])
                for name, case in cases:
                    b = budget(shape, case, device)
                    n = case.context
                    act = [activation_bytes(shape, n, case.dtype, c) for c in (False, True)]
                    head = head_bytes(shape, math.ceil(n * case.trained_share))
                    kv = shape.kv_bytes_per_token() * n
                    server = (f"vLLM {gb(b.items['vLLM awake'])} / {gb(b.items['vLLM asleep'])}"
                              if case.server == "vllm" else f"built-in {gb(b.items['server'])} / "
                              f"{gb(b.items['server'])}")
                    held = f"{b.kv_tokens / n:.1f}" if b.kv_tokens is not None else "1 (built-in)"
                    settings = (f"**{name}**: {'nf4' if case.quantization == '4bit' else 'bf16'}, ckpt "
                                f"{'on' if case.checkpointing else 'off'}, {case.rows} row{'s' * (case.rows > 1)}"
                                + (f", util {case.gpu_memory_utilization:g}" if case.server == "vllm" else
                                   ", built-in server on the GPU")
                                + (f", **serve.max_model_len = {n}**" if n != context else ""))
                    out.append(f"| {label} | {context // 1024}k | {device_label} | {settings} | "
                               f"{gb(b.items['weights'])} | {gb(b.items['LoRA + AdamW'])} | {gb(act[0])} / "
                               f"{gb(act[1])} | {gb(head)} | {server} | {gb(kv)} / {held} | {gb(b.update)} | "
                               f"{gb(b.collect)} | {'yes' if b.fits else 'no'} |")
                if picked is None:
                    out.append(f"| {label} | {context // 1024}k | {device_label} | **nothing fits** one device "
                               f"of this size | | | | | | | | | no |")
    return "\n".join(out)

if __name__ == "__main__":
    print(table())
