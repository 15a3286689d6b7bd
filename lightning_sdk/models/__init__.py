"""Finding and loading base models: `builtin:` and `tiny:` names (built by `models.tiny`), local directories and
Hugging Face hub ids."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sdk.files import load_py_file

BUILTIN = "builtin:"
FAMILY = "family:"  # family:<name>: a small random-weight model of a real family with its chat format (models.families)
SHAPE = "shape:"  # shape:<family>[@layers]: a real family's shape with random weights (models.shapes)
TINY = "tiny:"  # tiny:<teacher.py>: a tiny model pretrained offline on what that file's `teacher` says
# builtin:<name> is tiny:<that teacher file of the repository>; a wheel install has no cookbook beside the package.
BUILTINS = {"tiny-arith": "cookbook/arith/teacher.py"}
REPO = Path(__file__).parents[2]  # lightning_sdk/models/__init__.py -> the checkout's root
# A teacher file's models built ahead of time (scripts/rebuild_models.py) sit in this folder beside it, so a fresh
# checkout starts without minutes of building; the name holds the recipe's key, so an edited teacher builds anew.
PREBUILT = "prebuilt"


class ModelLoadError(RuntimeError):
    pass


def resolve(name: str) -> str:
    """Turn a configured model name into something `from_pretrained` takes.

    `shape:<family>[@layers]` is a real family's shape with random weights (`shapes`), built on first use;
    `family:<name>` a small random-weight model of a real family with that family's chat format (`families`);
    `tiny:<path/teacher.py>` is built locally on first use (a tiny model pretrained on the `teacher` that file
    defines; see `tiny.Teacher`), and so is `builtin:tiny-arith` (the repository's cookbook/arith/teacher.py),
    unless the teacher's `prebuilt/` folder ships the model its current recipe makes; an
    existing directory is used as it is; anything else is a hub id, which loads from the local Hugging Face cache
    (or the hub, where one is reachable).
    """
    if name.startswith(BUILTIN):
        return _build_tiny(name, _builtin_teacher(name))
    if name.startswith(TINY):
        return _build_tiny(name, Path(name[len(TINY):]).expanduser())
    if name.startswith(FAMILY):
        from lightning_sdk.models import families

        try:
            return str(families.ensure_built(name))
        except families.FamilyError as e:
            raise ModelLoadError(str(e)) from None
    if name.startswith(SHAPE):
        from lightning_sdk.models import shapes

        try:
            return str(shapes.ensure_built(name))
        except shapes.ShapeError as e:
            raise ModelLoadError(str(e)) from None
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"model {name!r}: directory has no config.json; expected a Hugging Face model directory")
        return str(path.resolve())
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ModelLoadError(f"model {name!r}: no such directory; expected a Hugging Face model directory (one "
                             f"holding config.json) or a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'")
    _check_hub_id(name)
    return name


LOCAL_HINT = ("to use a model you have on disk, set model.name to its directory (the one holding config.json), "
              "e.g. a snapshot under ~/.cache/huggingface/hub/models--ORG--NAME/snapshots/")


def _check_hub_id(name: str) -> None:
    """Fail fast on a hub id that cannot load: the local cache first, then one short request (no retries).

    Loading it the long way (transformers' own hub client) retried for over a minute before failing.
    """
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except HFValidationError as e:
        raise ModelLoadError(f"model {name!r}: not a valid hub id ({e}); {LOCAL_HINT}") from None
    if isinstance(cached, str):
        return
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"model {name!r}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                             f"{LOCAL_HINT}")
    import httpx

    url = f"{constants.ENDPOINT}/api/models/{name}"
    headers = {}
    from huggingface_hub import get_token

    token = get_token()
    if token:
        headers["authorization"] = f"Bearer {token}"
    try:
        answer = httpx.get(url, headers=headers, timeout=10, follow_redirects=True)
    except httpx.HTTPError as e:
        raise ModelLoadError(f"model {name!r}: not in the local Hugging Face cache, and the hub "
                             f"({constants.ENDPOINT}) cannot be reached ({type(e).__name__}: {e}); {LOCAL_HINT}") from None
    if answer.status_code in (401, 403, 404):
        raise ModelLoadError(f"model {name!r}: the hub has no such model, or it is private or gated (HTTP "
                             f"{answer.status_code}; `huggingface-cli login` for those); {LOCAL_HINT}")


def _builtin_teacher(name: str) -> Path:
    file = BUILTINS.get(name[len(BUILTIN):])
    if file is None:
        known = ", ".join(BUILTIN + b for b in BUILTINS)
        raise ModelLoadError(f"model {name!r}: unknown builtin model; expected {known}")
    if not (REPO / file).exists():
        raise ModelLoadError(f"model {name!r}: {name} is built from {file} of the lightning-sdk repository, which this "
                             f"install does not have; use tiny:<path/to/teacher.py>")
    return REPO / file


@dataclass
class TinyRecipe:
    """What a teacher file says to build: its `teacher` (keyed on the file's content), `steps` and `batch`."""

    teacher: Any
    steps: int
    batch: int
    prebuilt: Path  # <the teacher's folder>/prebuilt: where a model built ahead of time for it is shipped


def tiny_recipe(path: Path, name: str | None = None) -> TinyRecipe:
    """Load a `tiny:` teacher file (`name` is the configured model name, for errors)."""
    import hashlib

    name = name or f"{TINY}{path}"
    if path.suffix != ".py" or not path.exists():
        raise ModelLoadError(f"model {name!r}: expected tiny:<path to a .py file that defines `teacher`>")
    mod = load_py_file(path, f"lightning_teacher_{path.stem}")
    teacher = getattr(mod, "teacher", None)
    if teacher is None or not callable(getattr(teacher, "samples", None)) or not isinstance(getattr(teacher, "key", None), str):
        raise ModelLoadError(f"model {name!r}: {path} must define `teacher` with a `key` and `samples(rng, n)`")

    class Keyed:  # the file's content is part of the cache key: an edited teacher builds a new model
        key = f"{teacher.key}-{hashlib.sha1(path.read_bytes()).hexdigest()[:10]}"

        def __getattr__(self, name: str):  # everything else is the teacher's own
            return getattr(teacher, name)

    return TinyRecipe(Keyed(), steps=int(getattr(mod, "steps", 300)), batch=int(getattr(mod, "batch", 128)),
                      prebuilt=path.parent / PREBUILT)


def _build_tiny(name: str, path: Path) -> str:
    from lightning_sdk.models import tiny

    recipe = tiny_recipe(path, name)
    return str(tiny.ensure_built(recipe.teacher, steps=recipe.steps, batch=recipe.batch, prebuilt=recipe.prebuilt,
                                 what=name if name.startswith(TINY) else f"{name}, taught by {path}"))


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name_or_path)
    # An offline miss can hand back an almost empty tokenizer instead of raising: refuse it here.
    if len(tok) < 64:
        raise ModelLoadError(f"model {name_or_path!r}: tokenizer has only {len(tok)} tokens; the files are missing or broken")
    if tok.chat_template is None:
        raise ModelLoadError(f"model {name_or_path!r}: tokenizer has no chat template; a chat (instruct) model is expected")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(name_or_path: str, *, dtype: str = "auto", quantization: str = "none", device: str = "cpu") -> Any:
    """Load the base model. `quantization="4bit"` loads nf4 weights through bitsandbytes (QLoRA), every other
    tensor in fp32; trainer and server both load it here."""
    import torch
    from transformers import AutoModelForCausalLM

    dtypes = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ModelLoadError(f"dtype {dtype!r}: expected one of {sorted(dtypes)}")
    kwargs: dict[str, Any] = {"dtype": dtypes[dtype]}
    if quantization == "4bit":
        from transformers import BitsAndBytesConfig

        compute = torch.bfloat16 if dtype in ("auto", "bfloat16") else dtypes[dtype]
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute,
        )
        kwargs["device_map"] = {"": device}
    elif quantization != "none":
        raise ModelLoadError(f"quantization {quantization!r}: expected 'none' or '4bit'")
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except OSError as e:
        raise ModelLoadError(f"model {name_or_path!r}: cannot load ({e})") from e
    if quantization == "none":
        model.to(device)
    else:
        # Every tensor nf4 leaves alone (norms, embeddings, the head) in fp32: what QLoRA's
        # prepare_model_for_kbit_training makes of it in the trainer. Done here, the server samples from the same
        # model the trainer scores, whatever the dtype.
        for param in model.parameters():
            if param.dtype in (torch.float16, torch.bfloat16) and type(param).__name__ != "Params4bit":
                param.data = param.data.to(torch.float32)
        # On a CPU with AVX512-BF16, bitsandbytes repacks an nf4 weight for its inference kernel at the first
        # no-grad forward in eval mode, for good; that kernel has no backward, so after the trainer's frozen pass
        # no gradient would flow through the base (and a biased layer, Qwen2's q/k/v, fails outright). Both copies
        # keep the one kernel that trains, so the server also samples with the kernel the trainer scores with.
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    return model


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The token ids that end a reply: the generation config's, the model config's and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
