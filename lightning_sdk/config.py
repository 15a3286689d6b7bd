"""`lightning.toml`: one pydantic model per table, validated once at the edge.

Every other module receives these typed objects and never reads the file itself. Unknown keys are errors
(a typo must not silently fall back to a default), and every error names the key it is about.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
import tomllib
from pathlib import Path
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# The `vllm serve` flags that serve.*, model.* and train.lora_r set, and those the backend always sets
# (servers/vllm.py builds them); extra_args must not repeat them.
VLLM_MANAGED_FLAGS = ("--host", "--port", "--served-model-name", "--api-key", "--enable-lora", "--max-lora-rank",
                      "--max-loras", "--dtype", "--max-model-len", "--gpu-memory-utilization", "--enable-sleep-mode",
                      "--logprobs-mode", "--generation-config", "--enable-auto-tool-choice", "--tool-call-parser",
                      "--reasoning-parser", "--structured-outputs-config", "--tensor-parallel-size",
                      "--tool-strict-level")


# serve.tool_call_parser / serve.reasoning_parser: vLLM 0.32.0's registries (the `gpu` extra's pin), as
# vllm.tool_parsers.ToolParserManager.list_registered() and ReasoningParserManager's give them; the vLLM lane's
# tests/test_vllm_cpu.py::test_parser_names_are_vllms fails when vLLM's own lists change.
VLLM_TOOL_CALL_PARSERS = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4",
    "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47", "granite",
    "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "internlm", "jamba",
    "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json", "llama4_pythonic", "longcat",
    "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral", "muse_glimmer", "olmo3", "openai", "phi4_mini_json",
    "plamo3", "poolside_v1", "pythonic", "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5",
    "xlam",
)
VLLM_REASONING_PARSERS = (
    "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41", "ernie45",
    "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2", "hunyuan_a13b", "hy_v3", "hy_v4",
    "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m2",
    "minimax_m2_append_think", "minimax_m3", "mistral", "muse_glimmer", "nemotron_v3", "olmo3", "openai_gptoss",
    "plamo3", "poolside_v1", "qwen3", "seed_oss", "step3", "step3p5",
)
# vLLM 0.32.0's --quantization methods (vllm.model_executor.layers.quantization.QUANTIZATION_METHODS), for
# serve.extra_args; the vLLM lane's tests/test_vllm_cpu.py::test_quantization_methods_are_vllms fails when it changes.
VLLM_QUANTIZATION_METHODS = (
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8", "modelopt_mixed",
    "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors", "experts_int8", "quark",
    "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8", "online", "fp8_per_tensor",
    "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8",
)


def flag_values(args: list[str], long: str, short: str) -> list[str]:
    """The values a command line gives one flag, in each form argparse reads: `--flag V`, `--flag=V`, `-s V`,
    `-s=V`, `-sV` (a flag at the end with no value gives none)."""
    values = []
    for i, a in enumerate(args):
        if a in (long, short):
            values += args[i + 1:i + 2]
        elif a.startswith((f"{long}=", f"{short}=")):
            values.append(a.split("=", 1)[1])
        elif a.startswith(short) and not a.startswith("--"):
            values.append(a[len(short):])
    return values


# In a run directory: the effective config the run started with, defaults included (`lightning run` writes it,
# the dashboard shows it and credits the run's rollouts with its rollout.* settings).
RUN_CONFIG_FILE = "config.json"
OUTCOME_FILE = "outcome.json"  # the run's status and, when it stopped, why (metrics.MetricsLog.write_outcome)


class ConfigError(ValueError):
    """A broken `lightning.toml`: the message names the key and what was expected."""


# Rewards set here (rollout.error_reward, failed_reward) have the bound every reward has (agent.MAX_ABS_REWARD,
# which this module cannot import: tests/test_nonfinite.py checks both agree).
MAX_ABS_REWARD = 1e6


class _Section(BaseModel):
    # No float key takes nan or inf (TOML can write both): one would reach the loss and every adapter tensor.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RunConfig(_Section):
    name: str = "run"
    dir: Path = Path("runs/run")
    iterations: int = Field(10, ge=1)
    seed: int = 0
    # "ray": rollouts and inference on a Ray cluster ([ray]); "remote": rollouts by `lightning worker` processes,
    # in the agent's own environment, on this machine or others ([remote], docs/remote.md); "processes": the run
    # starts rollout.concurrency local workers, one rollout at a time each (an agent not safe to run in threads)
    runtime: Literal["embedded", "ray", "remote", "processes"] = "embedded"
    report_to: list[Literal["tensorboard", "mlflow", "wandb", "trackio"]] = Field(
        default_factory=lambda: ["tensorboard"], description="experiment trackers that get every iteration's "
        "metrics and the eval scores (metrics.jsonl always does); all but tensorboard need the [track] extra")
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP collector (base URL, e.g. http://127.0.0.1:4318) "
                                      "that also gets every rollout span; none = OTEL_EXPORTER_OTLP_ENDPOINT, if set")

    @field_validator("report_to")
    @classmethod
    def _unique_trackers(cls, v):
        if len(set(v)) != len(v):
            raise ValueError("names a tracker twice")
        return v

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, v):
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL (OTLP over HTTP)")
        return v

    @field_validator("name")
    @classmethod
    def _adapter_name(cls, v):
        # It names every LoRA adapter (`NAME-iterN`): peft refuses '.' in adapter names, and paths and URLs
        # take the rest badly.
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", v):
            raise ValueError("expected 1-64 letters, digits, '-' or '_' (starting with a letter or digit): it names "
                             "the run's LoRA adapters, which may not contain '.', '/' or spaces")
        return v


class AgentConfig(_Section):
    module: str = Field(description="a .py path or a dotted module that holds the @rollout and @reward functions")
    rollout: str | None = None  # name of the @rollout function; optional if the module has exactly one
    reward: str | None = None
    redirect_openai: bool = Field(True, description="during a run, point the agent process's OpenAI clients at "
                                  "the run's server (OPENAI_BASE_URL, OPENAI_API_KEY, set before the module is "
                                  "imported); false for agents that also call other OpenAI-compatible services")


class DataConfig(_Section):
    train: Path
    # tasks scored before and after training, ideally held out (training tasks are scored too, and every output then
    # says "score on the training tasks"); none = no eval pass
    eval: Path | None = None
    tasks_per_iteration: int = Field(16, ge=1)
    group_size: int = Field(8, ge=2, description="rollouts per task: the GRPO group")
    shuffle: bool = True
    required_fields: list[str] = Field(default_factory=list, description="fields every row must have (the ones "
                                       "the agent reads): checked for each row when the dataset loads")


class ModelConfig(_Section):
    name: str = "builtin:tiny-arith"  # or a hub id, a model directory, tiny:<teacher.py>, shape:<family> (models.resolve)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["none", "4bit"] = "none"


class ServeConfig(_Section):
    backend: Literal["cpu", "vllm", "auto"] = "cpu"
    # Where agents reach the run's server (the gateway, gateway/proxy.py): every runtime's agents and remote
    # workers call it; the inference backends behind it listen on 127.0.0.1 (Ray's actors: their node's IP).
    host: str = Field("127.0.0.1", description="address the run's server listens on; a reachable one for "
                                                "agents on other machines (Ray nodes, remote workers)")

    @field_validator("host")
    @classmethod
    def _host(cls, v):
        # An IP address, or a host name (RFC 1123 labels); whether it is this machine's is checked at start.
        try:
            ipaddress.ip_address(v)
            return v
        except ValueError:
            pass
        label = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
        if re.fullmatch(r"[0-9.]+", v) or not re.fullmatch(rf"{label}(\.{label})*", v):
            raise ValueError("expected an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1) or a host name")
        return v
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    api_key: str | None = Field(None, description="the key agents (and remote workers) present to the run's "
                                "server; none = a new one for each run")
    model_names: list[str] = Field(default_factory=list, description="model names the agent may ask for, each "
                                   "served by the policy being trained; empty = any name")

    @field_validator("model_names")
    @classmethod
    def _names(cls, v):
        if any(not n or not n.isprintable() for n in v):
            raise ValueError("expected non-empty printable model names")
        return v
    store_text: bool = Field(True, description="keep each call's message text (the prompt's messages, the reply, "
                             "completion token texts, tool definitions) in its record, for the dashboard and "
                             "`lightning traces`; false keeps only what training reads: token ids, log-probs, the "
                             "constraint and sampling settings")
    max_batch_size: int = Field(64, ge=1)
    max_model_len: int | None = Field(None, ge=16, description="prompt + completion tokens one call may hold; none = "
                                      "the model's own context (max_position_embeddings; 4096 for builtin: and tiny: "
                                      "models), as vLLM does")
    startup_timeout: float = Field(300.0, gt=0, description="seconds a starting inference server (vLLM or the "
                                   "built-in) may go without writing to its log: the wait for /health goes on while "
                                   "its process lives and its log grows (loading, compiling, capturing graphs), and "
                                   "stops after this long with no new line, at once when the process exits, or at 12 "
                                   "x this in all")
    device: str = Field("cpu", description="where the built-in server (backend 'cpu', transformers) runs the "
                                           "model: 'cpu', 'cuda' or 'cuda:N'; vLLM always takes the GPU")

    @field_validator("device")
    @classmethod
    def _serve_device(cls, v):
        if not re.fullmatch(r"cpu|cuda(:\d+)?", v):
            raise ValueError("expected 'cpu', 'cuda' or 'cuda:N'")
        return v

    replicas: int | None = Field(None, ge=1, description="inference servers behind the gateway, each request to "
                                 "the least loaded, every adapter loaded into each; none = as many as the serving "
                                 "GPUs hold at tensor_parallel_size each (1 on the CPU). run.runtime 'ray': "
                                 "ray.servers")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per vLLM replica (vLLM's --tensor-parallel-size)")

    # backend = "vllm" only (docs/gpu.md):
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="share of GPU memory vLLM may take")
    sleep_level: Literal[0, 1] = Field(1, description="vLLM sleep mode during the update phase: 1 = offload "
                                                      "weights, free the KV cache; 0 = stay awake")
    max_loras: int = Field(2, ge=1, description="LoRA adapters vLLM holds on the GPU at once; at least 2 per "
                                                 "policy are given (each new adapter loads before the old one goes)")
    extra_args: list[str] = Field(default_factory=list, description="more `vllm serve` flags, e.g. --enforce-eager")
    # Both backends take them (the built-in server reads and forces calls in that parser's format)
    tool_call_parser: str = Field("auto", description="vLLM's --tool-call-parser: 'auto' = the one the model's chat "
                                  "template / model_type calls for (hermes for Qwen2.5 and builtin: models), 'none' "
                                  "= no tool calling, or a parser name (e.g. hermes, llama3_json, mistral)")
    reasoning_parser: str = Field("auto", description="vLLM's --reasoning-parser: 'auto' = the one a reasoning "
                                  "model calls for (qwen3, deepseek_r1, ...), 'none', or a parser name")

    @field_validator("tool_call_parser", "reasoning_parser")
    @classmethod
    def _known_parser(cls, v, info):
        names = VLLM_TOOL_CALL_PARSERS if info.field_name == "tool_call_parser" else VLLM_REASONING_PARSERS
        if v not in ("auto", "none", *names):
            raise ValueError(f"{v!r} is not one of vLLM's parsers; expected 'auto', 'none' or one of "
                             f"{', '.join(names)}")
        return v

    @field_validator("api_key")
    @classmethod
    def _usable_key(cls, v):
        # An empty key used to turn authentication off without a word; a header cannot carry spaces or non-ASCII.
        if v is not None and (not v or not v.isascii() or not v.isprintable() or " " in v):
            raise ValueError("must be a non-empty string of printable ASCII without spaces; leave serve.api_key "
                             "out to get a new key for each run")
        return v

    @field_validator("extra_args")
    @classmethod
    def _not_managed(cls, v):
        taken = [a for a in v if a.split("=")[0] in VLLM_MANAGED_FLAGS]
        if taken:
            raise ValueError(f"{taken} are set from other keys (serve.*, model.*, train.lora_r); remove them")
        for method in flag_values(v, "--quantization", "-q"):
            if method not in VLLM_QUANTIZATION_METHODS:
                # vLLM would refuse it only once started, after the model's config is read.
                raise ValueError(f"--quantization {method!r} is not one of vLLM's quantization methods; expected "
                                 f"one of {', '.join(VLLM_QUANTIZATION_METHODS)} (QLoRA's 4-bit base is the "
                                 f"trainer's: model.quantization = '4bit')")
        return v


class RolloutConfig(_Section):
    concurrency: int = Field(32, ge=1)
    timeout: float = Field(120.0, gt=0, description="seconds one rollout may take before it is recorded as failed")
    components: list[str] = Field(default_factory=list, description="LLM-call components to train; empty = all")
    error_reward: float = Field(-1.0, ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD,
                                description="intermediate reward for each failed tool span, credited to the LLM call "
                                            "before it (docs/credit.md); failed LLM calls get none")
    credit: str = Field("lightning_rl", description="credit-assignment rule: a builtin name or 'module:function'")
    failed_reward: float | None = Field(
        None, ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD,
        description="episode reward for a rollout whose agent raised: its captured LLM calls train with it; "
                    "none = failed rollouts are left out. Timeouts and server faults are never penalised")
    on_reward_error: Literal["skip", "stop"] = Field(
        "skip", description="a @reward that raises or returns no finite number: 'skip' fails that rollout (it is "
                            "left out of training), 'stop' ends the run after the phase, naming rollout and value")


# importance_sampling_cap "auto" with vLLM: TRL's vllm_importance_sampling_cap default is 2 (of a 2-3 range in use).
AUTO_IS_CAP = 2.0


def nonempty_targets(v):
    """train.target_modules, in [train] or a policy: a list names at least one module."""
    if isinstance(v, list) and not v:
        raise ValueError("must name at least one module, or be 'all-linear'")
    return v


class TrainConfig(_Section):
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    beta: float = Field(0.0, ge=0, description="KL coefficient against the base model (adapter disabled)")
    clip_eps: float = Field(0.2, gt=0)
    clip_eps_high: float | None = Field(None, gt=0, description="upper clip (DAPO clip-higher); default clip_eps")
    loss_norm: Literal["rollout", "token", "sequence", "constant", "bnpo"] = Field(
        "rollout", description="loss aggregation (docs/credit.md): 'constant' is Dr.GRPO, 'bnpo' TRL's bnpo")
    max_completion_length: int | None = Field(None, ge=1, description="the constant L of loss_norm = 'constant' "
                                              "(Dr.GRPO's N x L normaliser): the longest completion max_tokens allows")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="divide advantages by the group's std, the batch's, or not at all (Dr.GRPO)")
    drop_zero_variance_groups: bool = Field(False, description="leave groups whose outcomes are all equal out of the "
                                            "update (they carry no signal but dilute the loss); logged either way")
    mask_truncated: bool = Field(False, description="leave completions cut by max_tokens (finish_reason 'length') "
                                                    "out of the loss")
    log_ratio_clamp: float = Field(20.0, gt=0, description="clamp of log(new/old) before exp (no inf/NaN)")
    dual_clip: float | None = Field(3.0, gt=1, description="dual-clip PPO: cap a negative-advantage token's loss at "
                                    "dual_clip x |A| (verl's clip_ratio_c, 3 as there), so a token whose ratio ran "
                                    "far up cannot push the policy without bound; 'off' turns it off")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear learning-rate warmup")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after warmup, over run.iterations x train.epochs optimizer steps")
    epochs: int = Field(1, ge=1, description="optimizer passes over each collected batch")
    micro_batch_size: int = Field(32, ge=1, description="most rows per forward/backward (gradient accumulation): a "
                                  "row is one call, or with pack_calls the calls packed together; a pass reads at "
                                  "most as many tokens as this many of the batch's longest call (padding "
                                  "included), and rows of very different lengths go in separate passes")
    pack_calls: bool = Field(True, description="train the calls of a rollout (one policy) whose prompts extend the "
                             "previous call's prompt + completion token for token as one sequence, and rows with the "
                             "same prompt (a group's rollouts) as branches of one sequence, so shared history is read "
                             "once (train.packing); the loss and gradients are those of separate rows. false: one row "
                             "per call (benchmarks/packed_update.py compares the two)")
    max_grad_norm: float = Field(1.0, gt=0)
    gradient_checkpointing: bool = False
    importance_sampling_cap: Annotated[float, Field(ge=1)] | Literal["auto"] | None = Field(
        "auto", description="truncated importance sampling against the sampler (TRL's vllm_importance_sampling_cap, "
                            "verl's TIS): each token's loss x min(exp(trainer - sampler logprob), cap). 'auto': "
                            f"{AUTO_IS_CAP:g} when the run serves with vLLM (serve.backend 'vllm', or 'auto' "
                            "resolving to it), whose kernels sample from a slightly other distribution; off on the "
                            "built-in server, which samples from the trainer's own. A number: always; 'off': never")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="the PPO ratio per token, or per sequence: exp(mean log-ratio of the completion) for "
                             "each of its tokens (GSPO; TRL's importance_sampling_level = 'sequence', which pairs "
                             "with much smaller clip_eps / clip_eps_high, e.g. 3e-4 / 4e-4)")
    max_staleness: int = Field(0, ge=0, description="pipelined training (docs/pipeline.md): 0 collects, updates "
                               "and hot-loads in turn; k >= 1 collects the next batch while the trainer updates, "
                               "from the newest adapter served, and leaves out a call whose adapter is more than k "
                               "updates behind the one being trained (train.stale_dropped); the importance weight "
                               "against the sampler's log-probs is then always on")
    device: str = "auto"
    processes: int = Field(1, ge=1, description="data-parallel trainer processes, launched by the run itself "
                           "(torch.distributed: gloo on the CPU, NCCL on GPUs; accelerate's num_processes, TRL's "
                           "world size): each takes a share of every batch's micro-batches, their gradients are "
                           "summed, every process steps alike and one writes the checkpoints. On GPUs one per "
                           "training GPU; 1 trains in the run's own process")
    shard: Literal["none", "fsdp"] = Field(
        "none", description="'none': every process holds the whole base model; 'fsdp': each holds 1/processes of "
                            "every parameter (torch's FSDP2), for a base that does not fit one device, at the cost of "
                            "gathering each layer's weights for every forward and backward pass (docs/scaling.md)")

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        if not re.fullmatch(r"auto|cpu|mps|(cuda|xpu)(:\d+)?", v):
            raise ValueError("expected 'auto', 'cpu', 'cuda', 'cuda:N', 'mps' or 'xpu[:N]'")
        return v

    @field_validator("dual_clip", "importance_sampling_cap", mode="before")
    @classmethod
    def _off(cls, v):
        return None if v == "off" else v  # TOML has no null: 'off' is how a file turns a safeguard off

    def sampling_cap(self, backend: str) -> float | None:
        """importance_sampling_cap for a run whose inference backend is `backend` ('cpu' or 'vllm'): 'auto' decided."""
        if self.importance_sampling_cap == "auto":
            # A stale sample came from an older adapter than the trainer's: only the weight corrects for that.
            return AUTO_IS_CAP if backend == "vllm" or self.max_staleness else None
        return self.importance_sampling_cap

    @model_validator(mode="after")
    def _staleness_needs_weights(self):
        if self.max_staleness and self.importance_sampling_cap is None:
            raise ValueError(f"train.max_staleness = {self.max_staleness} trains on samples of older adapters, which "
                             f"only the importance weight corrects: set train.importance_sampling_cap to 'auto' or "
                             f"a number, not 'off'")
        return self

    @model_validator(mode="after")
    def _processes_need_a_device_each(self):
        if self.processes > 1 and self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train.processes = {self.processes} gives each process a device of its own, so "
                             f"train.device = {self.device!r} cannot name one: expected 'auto', 'cpu' or 'cuda'")
        return self

    @model_validator(mode="after")
    def _shard_needs_processes(self):
        if self.shard == "fsdp" and self.processes < 2:
            raise ValueError(f"train.shard = 'fsdp' splits the base model over the trainer processes: expected "
                             f"train.processes >= 2 (it is {self.processes}), or train.shard = 'none'")
        return self

    @model_validator(mode="after")
    def _constant_needs_length(self):
        if self.loss_norm == "constant" and self.max_completion_length is None:
            raise ValueError("train.loss_norm = 'constant' (Dr.GRPO) needs train.max_completion_length, the constant "
                             "tokens-per-completion of its normaliser")
        return self

    @field_validator("target_modules")
    @classmethod
    def _nonempty(cls, v):
        return nonempty_targets(v)


# The train.* keys a policy may set for itself: what its adapter and its optimizer are. Every other key shapes the one
# update all policies share (its loss, its batches, its schedule), so it stays in [train].
POLICY_KEYS = ("lr", "lora_r", "lora_alpha", "target_modules")


class LearnConfig(_Section):
    """[learn]: `lightning serve` trains an adapter from the rewarded calls it recorded, in the background, and
    promotes it past the gate (docs/serve.md). [train] sets the update itself (lr, beta, LoRA shape, ...)."""

    every_rewarded: int = Field(16, ge=1, description="an update once this many rewards arrived since the last one")
    every_minutes: float | None = Field(None, gt=0, description="also an update once this many minutes passed since "
                                        "the last one with at least one new reward; none: by count only")
    max_versions_behind: int = Field(2, ge=0, description="K: a call served by an adapter more than K updates older "
                                     "than the one being trained is left out (counted: stale); the importance "
                                     "weight against its sampler log-probs corrects the ones kept")
    reward_name: str = Field("reward", min_length=1, description="the feedback name trained on (ls.feedback name)")
    alpha: float = Field(0.1, gt=0, le=1, description="weight of the per-component running baseline "
                         "(production.traffic_advantage)")
    gate_margin: float = Field(0.0, ge=0, description="a candidate is promoted only if, on data.eval's tasks, its "
                               "lower bound (mean difference - gate_z x standard error) is >= -gate_margin")
    gate_z: float = Field(1.645, ge=0, description="z of the gate's one-sided bound (1.645: 95%)")
    poll_seconds: float = Field(2.0, gt=0, description="how often the trainer looks for new rewards")
    max_update_failures: int = Field(3, ge=1, le=100, description="an update that raises this many times in a row "
                                     "quarantines the rewards it read (consumed untrained, with the error as the "
                                     "reason, counted) so learning goes on")
    canary_share: float | None = Field(None, gt=0, lt=1, description="a candidate past the gate first serves this "
                                       "share of new episodes, then is promoted or rolled back by live reward "
                                       "(production.canary); none: promoted at once")
    canary_min_rewards: int = Field(30, description="the canary is decided once it and the serving adapter each "
                                    "have this many rewarded episodes since it started (2 to 10^6; the episode is "
                                    "the unit: its calls share one reward; a call of no episode rewarded by its id "
                                    "counts as one)")

    @field_validator("canary_min_rewards")
    @classmethod
    def _episodes(cls, v: int) -> int:
        if not 2 <= v <= 1_000_000:
            raise ValueError("expected 2 to 10^6 rewarded episodes a side (the canary's unit is the episode)")
        return v


class PolicyConfig(_Section):
    """`[policies.NAME]`: one LoRA adapter, trained on the calls of `components` only, with its own optimizer."""

    components: list[str] = Field(description="the `ls.component` names whose calls this policy serves and trains")
    lr: float | None = Field(None, gt=0, description="this policy's train.lr; none = train.lr")
    lora_r: int | None = Field(None, ge=1, description="this policy's train.lora_r; none = train.lora_r")
    lora_alpha: int | None = Field(None, ge=1, description="this policy's train.lora_alpha; none = train.lora_alpha")
    target_modules: list[str] | Literal["all-linear"] | None = Field(
        None, description="this policy's train.target_modules; none = train.target_modules")

    @model_validator(mode="before")
    @classmethod
    def _only_policy_keys(cls, data):
        # A shared key set here would be silently the same for every policy: name it, and where it belongs.
        if isinstance(data, dict):
            shared = [k for k in data if k in TrainConfig.model_fields and k not in POLICY_KEYS]
            if shared:
                raise ValueError(f"{shared[0]} cannot vary per policy (a policy may set only "
                                 f"{', '.join(POLICY_KEYS)}); set train.{shared[0]} for all")
        return data

    @field_validator("components")
    @classmethod
    def _some(cls, v):
        if not v:
            raise ValueError("an empty policy: name the components whose calls it trains")
        if any(not c or not c.isprintable() for c in v) or len(set(v)) != len(v):
            raise ValueError("expected distinct, non-empty component names")
        return v

    @field_validator("target_modules")
    @classmethod
    def _nonempty(cls, v):
        return nonempty_targets(v)


@dataclass(frozen=True)
class Policy:
    """One adapter of a run, as the trainer, the server and the gateway see it: its name, the components whose
    calls it serves and trains (empty: every component), and its train.* with the policy's own keys applied."""

    name: str
    components: tuple[str, ...]
    train: TrainConfig


def gpu_indices(v):
    """devices.serve / devices.train: distinct GPU indices."""
    if v is not None and (not v or len(set(v)) != len(v)):
        raise ValueError("expected a non-empty list of distinct GPU indices, e.g. [0, 1]")
    return v


class DevicesConfig(_Section):
    """Which of the visible GPUs (CUDA_VISIBLE_DEVICES, counted from 0) serve and which train (placement.py,
    docs/scaling.md). None: a split of the visible GPUs, said in the run's first lines."""

    serve: list[Annotated[int, Field(ge=0)]] | None = Field(None, description="the inference servers' GPUs, split "
                                                            "into serve.replicas sets of serve.tensor_parallel_size")
    train: list[Annotated[int, Field(ge=0)]] | None = Field(None, description="the trainer's GPUs; the same as "
                                                            "devices.serve: shared in turns (vLLM sleeps during each "
                                                            "update); apart: pipelined (train.max_staleness = 1)")

    @field_validator("serve", "train")
    @classmethod
    def _indices(cls, v):
        return gpu_indices(v)

    @model_validator(mode="after")
    def _same_or_apart(self):
        if self.serve is not None and self.train is not None:
            both = set(self.serve) & set(self.train)
            if both and set(self.serve) != set(self.train):
                raise ValueError(f"serve = {self.serve} and train = {self.train} share GPU(s) "
                                 f"{sorted(both)}: expected the same GPUs (serving and training in turns) or none "
                                 f"in common")
        return self


class RayConfig(_Section):
    """Used when run.runtime = "ray" (the `[ray]` extra); see docs/scaling.md."""

    address: str | None = Field(None, description="Ray cluster to join ('auto', 'ray://...'); none = start a local one")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local cluster started when address is none")
    object_store_memory: int | None = Field(None, ge=78_643_200, description="bytes, local cluster (min 75 MiB)")
    num_workers: int = Field(2, ge=1, description="rollout-worker actors")
    cpus_per_worker: float = Field(0.5, gt=0)
    worker_concurrency: int | None = Field(None, ge=1, description="rollouts at once per worker; "
                                                                   "none = rollout.concurrency / num_workers")
    servers: int = Field(1, ge=1, description="inference-server actors behind the router")
    cpus_per_server: float = Field(1.0, gt=0)
    gpus_per_server: float = Field(0, ge=0, description="GPUs each server actor holds (its GPU set: a placement "
                                                         "group bundle); serve.backend 'vllm' on GPUs needs >= 1")
    max_retries: int = Field(1, ge=0, description="re-runs of a rollout whose worker died")


class RemoteConfig(_Section):
    """Used when run.runtime = "remote": `lightning worker` processes claim the rollouts (docs/remote.md)."""

    worker_timeout: float = Field(300.0, gt=0, description="seconds without a request from any worker while "
                                  "rollouts wait for one (none claimed) before the run stops, saying how to start one")
    grace: float = Field(30.0, ge=0, description="seconds a claimed rollout's result may come after rollout.timeout "
                         "(its reward, span delivery and report); later, the claim is abandoned (spans kept) and the "
                         "rollout re-run once under a new id")


# Runtimes whose agent runs elsewhere (remote workers): [agent] is optional for them, and the trainer never imports
# it. Their collector says so too (`runs_agent = False`, read by the runtime); tests/test_layout.py checks both agree.
AGENT_ELSEWHERE = ("remote",)


# train.* defaults for the tiny models (builtin:, tiny:): the global ones (lr 1e-4, r 16, no lm_head, 1 epoch) suit
# a pretrained instruct model, but leave a tiny model's reward flat (eval 0.05 -> 0.05 with a minimal config); with
# these it learns (tests/test_first_run.py). A key the file sets wins.
TINY_TRAIN_DEFAULTS: dict[str, Any] = {"lr": 2e-3, "lora_r": 8, "lora_alpha": 16, "epochs": 2,
                                       "target_modules": ["all-linear", "lm_head"]}  # untied random-init head


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    agent: AgentConfig | None = Field(None, description="required unless run.runtime runs the agent elsewhere "
                                      "(AGENT_ELSEWHERE: 'remote', where workers name their module)")
    data: DataConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    devices: DevicesConfig = Field(default_factory=DevicesConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    remote: RemoteConfig = Field(default_factory=RemoteConfig)
    learn: LearnConfig | None = Field(None, description="[learn]: `lightning serve` trains from its rewarded calls "
                                      "and promotes past the gate; none = it serves only")
    policies: dict[str, PolicyConfig] = Field(
        default_factory=dict, description="one LoRA adapter per role: [policies.NAME] components = [...]; none = "
        "one policy, named after the run, for rollout.components (docs: README, 'One policy per component')")

    @model_validator(mode="after")
    def _learn_needs_evals(self):
        if self.learn is not None and self.policies:
            raise ValueError("[learn] trains one adapter from served traffic; [policies] (an adapter per role) is "
                             "not supported with it: remove one of them")
        if self.learn is not None and self.data.eval is None:
            raise ValueError("[learn] promotes a candidate only past the gate, which scores it on data.eval's tasks: "
                             "set data.eval")
        return self

    @model_validator(mode="after")
    def _policies_partition(self):
        if self.policies and self.rollout.components:
            raise ValueError("rollout.components and [policies] both choose the components to train: keep one of "
                             "them ([policies.NAME] components for an adapter per role, or rollout.components for "
                             "one shared adapter)")
        owner: dict[str, str] = {}
        for name, p in self.policies.items():
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", name) or name in "lora_" or name == "default":
                # It names the policy's adapters (peft's, the server's, a directory): peft takes names inside its
                # 'lora_' prefix, and 'default', for its own.
                raise ValueError(f"policies.{name}: expected 1-64 letters, digits, '-' or '_' (starting with a "
                                 f"letter or digit), not 'default' nor part of 'lora_': it names the policy's "
                                 f"adapters")
            for c in p.components:
                if c in owner:
                    raise ValueError(f"policies.{name}.components: {c!r} is already in policies.{owner[c]}; a "
                                     f"component's calls are served and trained by one policy")
                owner[c] = name
        return self

    @model_validator(mode="after")
    def _sharding(self):
        if self.train.shard != "fsdp":
            return self
        if self.model.quantization == "4bit":
            # FSDP shards 4-bit weights only with bnb_4bit_quant_storage set to the float dtype, which the loader
            # does not set and no machine here can test (bitsandbytes needs a GPU).
            raise ValueError("model.quantization = '4bit' with train.shard = 'fsdp': sharding a 4-bit base is not "
                             "supported; set train.shard = 'none' (QLoRA on each process) or model.quantization = "
                             "'none'")
        if self.policies:
            raise ValueError(f"[policies] ({', '.join(self.policies)}) with train.shard = 'fsdp': a sharded base "
                             f"trains one adapter; set train.shard = 'none' or keep one policy")
        return self

    @model_validator(mode="after")
    def _tiny_model_defaults(self):
        if self.model.name.startswith(("builtin:", "tiny:")):
            for key, value in TINY_TRAIN_DEFAULTS.items():
                if key not in self.train.model_fields_set:
                    setattr(self.train, key, value)
                    self.train.model_fields_set.discard(key)  # still a default: see override()
        return self

    @model_validator(mode="after")
    def _placement(self):
        s, d = self.serve, self.devices
        if s.tensor_parallel_size > 1 and s.backend == "cpu":
            raise ValueError(f"serve.tensor_parallel_size = {s.tensor_parallel_size}: tensor parallelism is vLLM's; "
                             f"expected 1 with serve.backend = 'cpu' (or serve.backend = 'vllm')")
        if self.run.runtime == "ray" and (s.replicas is not None or d.serve is not None or d.train is not None):
            key = "serve.replicas" if s.replicas is not None else "devices"
            raise ValueError(f"{key}: with run.runtime = 'ray', Ray places the servers: set ray.servers and "
                             f"ray.gpus_per_server instead")
        if self.run.runtime == "ray" and s.tensor_parallel_size > 1 and self.ray.gpus_per_server != s.tensor_parallel_size:
            raise ValueError(f"ray.gpus_per_server = {self.ray.gpus_per_server:g}: expected serve.tensor_parallel_size = "
                             f"{s.tensor_parallel_size} GPUs for each server actor")
        if d.serve is not None and s.replicas is not None and len(d.serve) != s.replicas * s.tensor_parallel_size:
            raise ValueError(f"devices.serve = {d.serve}: expected serve.replicas x serve.tensor_parallel_size = "
                             f"{s.replicas} x {s.tensor_parallel_size} GPUs")
        if d.serve is not None and len(d.serve) % s.tensor_parallel_size:
            raise ValueError(f"devices.serve = {d.serve}: expected a multiple of serve.tensor_parallel_size = "
                             f"{s.tensor_parallel_size} GPUs")
        if d.serve is not None and s.backend == "cpu" and s.device == "cpu":
            raise ValueError(f"devices.serve = {d.serve}: the built-in server runs on the CPU (serve.device = 'cpu'); "
                             f"set serve.device = 'cuda' (or serve.backend = 'vllm') to serve on GPUs")
        if d.serve is not None and s.device not in ("cpu", "cuda"):
            raise ValueError(f"serve.device = {s.device!r} and devices.serve both place the server: keep "
                             f"devices.serve (and serve.device = 'cuda' for the built-in server)")
        if d.train is not None and self.train.device not in ("auto", "cuda"):
            raise ValueError(f"train.device = {self.train.device!r} and devices.train both place the trainer: keep "
                             f"devices.train (train.device 'auto' or 'cuda')")
        return self

    @model_validator(mode="after")
    def _agent_here(self):
        if self.agent is None and self.run.runtime not in AGENT_ELSEWHERE:
            raise ValueError(f"agent: required key is missing (run.runtime = {self.run.runtime!r} runs the agent in "
                             f"this run; [agent] module names it)")
        return self


def policies(cfg: Config) -> list[Policy]:
    """The run's policies: its [policies] tables in order, or the one policy named after the run."""
    if not cfg.policies:
        return [Policy(cfg.run.name, tuple(cfg.rollout.components), cfg.train)]
    out = []
    for name, p in cfg.policies.items():
        own = {k: getattr(p, k) for k in POLICY_KEYS if getattr(p, k) is not None}
        out.append(Policy(name, tuple(p.components), cfg.train.model_copy(update=own)))
    return out


def _keys_at(loc: tuple) -> list[str]:
    """The keys a table at `loc` (("train",), ("policies", "fixer"), () for the top level) may hold."""
    model: Any = Config
    for part in loc:
        field = model.model_fields.get(str(part)) if isinstance(model, type) else None
        if field is None:  # a key of a dict of tables ([policies.NAME]): the tables' model stays
            continue
        types = [field.annotation]
        model = None
        while types:  # the first table model in the annotation (X | None, dict[str, X])
            t = types.pop(0)
            if isinstance(t, type) and issubclass(t, BaseModel):
                model = t
                break
            types += list(get_args(t))
        if model is None:
            return []
    return list(model.model_fields)


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            near = difflib.get_close_matches(str(e["loc"][-1]), _keys_at(e["loc"][:-1]), n=1, cutoff=0.6)
            lines.append(f"{key}: unknown key" + (f"; did you mean {'.'.join(map(str, (*e['loc'][:-1], near[0])))}?"
                                                  if near else ""))
        elif e["type"] == "missing":
            lines.append(f"{key}: required key is missing")
        elif e["type"] == "value_error" and not e["loc"]:  # a rule across keys: its message names them
            lines.append(e["msg"].removeprefix("Value error, "))
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):  # a rule over a table's keys
            lines.append(f"{key}: {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"{key}: {e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})")
    return "; ".join(lines)


def effective(cfg: Config) -> dict[str, Any]:
    """Every key's value, defaults included, as JSON; serve.api_key is a secret and is only said to be set."""
    out = cfg.model_dump(mode="json")
    if out.get("serve", {}).get("api_key") is not None:
        out["serve"]["api_key"] = "(set, not shown)"
    return out


def parse(data: dict, *, base: Path | None = None) -> Config:
    """Validate a decoded TOML document; relative paths are taken from `base` (the file's folder)."""
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e)) from None
    if base is not None:
        def rel(p: Path | None) -> Path | None:
            return p if p is None or p.is_absolute() else base / p
        cfg.run.dir = rel(cfg.run.dir)
        cfg.data.train = rel(cfg.data.train)
        cfg.data.eval = rel(cfg.data.eval)
        if cfg.model.name.startswith("tiny:") and not Path(cfg.model.name[5:]).is_absolute():
            cfg.model.name = f"tiny:{base / cfg.model.name[5:]}"
        if cfg.agent is not None and cfg.agent.module.endswith(".py") and not Path(cfg.agent.module).is_absolute():
            cfg.agent.module = str(base / cfg.agent.module)
    return cfg


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    try:
        return parse(data, base=path.resolve().parent)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def override(cfg: Config, values: dict[str, Any]) -> Config:
    """`cfg` with dotted keys set ({"run.iterations": 2, "train.lr": 1e-3}), validated like the file itself.

    Values are taken as given: a relative path is relative to the current directory (as a command-line flag's).
    """
    if not values:
        return cfg
    # Only what was set (in the file, or by parse's path resolution): a default stays a default, so the per-model
    # defaults follow a changed model.name.
    data = {name: _set_fields(getattr(cfg, name)) for name in Config.model_fields}
    for key, value in values.items():
        section, _, name = key.partition(".")
        if not name or "." in name:
            raise ConfigError(f"{key}: expected a dotted key 'section.key' (e.g. 'train.lr')")
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{key}: {section} is not a table")
        table[name] = value
    return parse(data)


def _set_fields(value: Any) -> Any:
    """A table as written: only the keys that were set ([policies]: each policy's)."""
    if isinstance(value, BaseModel):
        return value.model_dump(include=value.model_fields_set)
    if isinstance(value, dict):
        return {k: _set_fields(v) for k, v in value.items()}
    return value


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}; lists and empty tables stay values. The dotted keys name a
    setting the same way in the dashboard, the trackers' parameters and `lightning.toml`."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
