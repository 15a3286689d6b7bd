"""Placement, in one place: which of the visible GPUs each inference server and the trainer get, from the config
and the number of GPUs this process sees. A pure function, so it is tested without GPUs; the processes get their
GPUs through CUDA_VISIBLE_DEVICES (`gpu_environment`), never by reaching into another library.

The default on N visible GPUs: one GPU is shared in turns, as it always was (vLLM sleeps during each update); two
or more are split, about half serving (inference is most of an agent run's time) and the rest training, and the
two sides then overlap (train.max_staleness = 1, where the config does not say)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_sdk.config import Config
from lightning_sdk.errors import SetupError


@dataclass(frozen=True)
class Placement:
    replicas: tuple[tuple[int, ...], ...]  # each local inference server's GPUs (visible indices; () = the CPU); none
    # with run.runtime = "ray", whose server actors Ray places
    train: tuple[int, ...]  # the trainer's GPUs; () = where train.device says (the CPU, MPS)
    visible: int  # GPUs this process sees

    @property
    def serving(self) -> tuple[int, ...]:
        return tuple(g for r in self.replicas for g in r)

    @property
    def shared(self) -> bool:
        """Serving and training on the same GPUs, in turns."""
        return bool(set(self.serving) & set(self.train))

    @property
    def apart(self) -> bool:
        """Serving and training on GPUs of their own, at once."""
        return bool(self.serving) and bool(self.train) and not self.shared

    def line(self) -> str:
        """The placement in one line, for the run's first lines."""
        def gpus(ids: tuple[int, ...]) -> str:
            return f"GPU{'s' if len(ids) > 1 else ''} {','.join(map(str, ids))}"

        n = len(self.replicas)
        servers = (f"{n} inference server{'s' if n > 1 else ''} on "
                   + ("the CPU" if not self.serving else "; ".join(gpus(r) for r in self.replicas))) if n else \
            "the inference servers where Ray places them"
        trainer = f"the trainer on {gpus(self.train)}" if self.train else "the trainer on the CPU/train.device"
        how = (", in turns (the server sleeps during each update)" if self.shared else
               ", at once (pipelined)" if self.apart else "")
        return f"placement: {self.visible} GPU(s) visible; {servers}, {trainer}{how}"


def place(cfg: Config, *, visible: int, backend: str) -> Placement:
    """Where each process runs for `cfg` on a machine with `visible` GPUs, whose servers run `backend` ('cpu' or
    'vllm', serve.backend resolved). A SetupError, naming the key, when the config asks for GPUs that are not
    there."""
    d, s = cfg.devices, cfg.serve
    tp = s.tensor_parallel_size
    for key, ids in (("devices.serve", d.serve), ("devices.train", d.train)):
        if ids is not None and max(ids) >= visible:
            raise SetupError(f"{key} = {ids}: " + (f"only {visible} GPU(s) are visible (0-{visible - 1})" if visible
                                                   else "no CUDA GPU is visible; leave [devices] out on the CPU"))
    if tp > 1 and backend != "vllm":
        raise SetupError(f"serve.tensor_parallel_size = {tp}: tensor parallelism is vLLM's, and this run serves "
                         f"with the built-in server (serve.backend resolved to 'cpu')")
    train_gpu = visible > 0 and (cfg.train.device == "auto" or cfg.train.device.startswith("cuda"))
    if cfg.run.runtime == "ray":  # Ray places the servers (ray.servers, ray.gpus_per_server); the trainer is here
        return Placement((), tuple(range(visible)) if train_gpu else (), visible)
    serve_gpu = visible > 0 and (backend == "vllm" or s.device.startswith("cuda"))
    serve = _pinned(d.serve, s.device, serve_gpu)
    train = _pinned(d.train, cfg.train.device, train_gpu)
    everything = tuple(range(visible))
    if serve is None and train is None:  # the split: on one GPU, both there; else the first share serves
        if not serve_gpu:
            serve, train = (), everything[:1] if train_gpu else ()
        elif not train_gpu:
            serve, train = everything[:max(tp, (s.replicas or visible // tp) * tp)], ()
        elif visible == 1:
            serve = train = everything
        else:
            k = (s.replicas * tp) if s.replicas else max(tp, -(-visible // 2) // tp * tp)
            serve = everything[:k]
            train = everything[k:] or serve
    elif serve is None:
        rest = tuple(g for g in everything if g not in train)
        serve = (rest or train)[:((s.replicas or max(1, len(rest or train) // tp)) * tp)] if serve_gpu else ()
    elif train is None:
        rest = tuple(g for g in everything if g not in serve)
        train = (rest or serve) if train_gpu else ()
    if serve and len(serve) < tp:
        raise SetupError(f"serve.tensor_parallel_size = {tp}: the servers have {len(serve)} GPU(s) ({list(serve)})")
    n = s.replicas or (len(serve) // tp if serve else 1)
    if serve and n * tp > len(serve):
        raise SetupError(f"serve.replicas = {n} x serve.tensor_parallel_size = {tp}: needs {n * tp} GPUs; the "
                         f"servers have {len(serve)} ({list(serve)}); set devices.serve or fewer replicas")
    procs = cfg.train.processes
    if train and len(train) < procs:
        raise SetupError(f"train.processes = {procs} takes one GPU each; the trainer has {len(train)} "
                         f"({list(train)}): set devices.train to {procs} GPUs or fewer processes")
    replicas = tuple(serve[i * tp:(i + 1) * tp] for i in range(n)) if serve else ((),) * n
    return Placement(replicas, tuple(train), visible)


def _pinned(ids: list[int] | None, device: str, on_gpu: bool) -> tuple[int, ...] | None:
    """The GPUs a side is pinned to: [devices], else a 'cuda:N' device; None when free to place."""
    if ids is not None:
        return tuple(ids)
    if on_gpu and device.startswith("cuda:"):
        return (int(device.partition(":")[2]),)
    return None


def defaults_for(cfg: Config, placement: Placement) -> list[str]:
    """Apart, serving and training overlap: train.max_staleness = 1, vLLM awake (serve.sleep_level = 0) with most of
    its GPUs' memory (serve.gpu_memory_utilization = 0.9), each where the config does not set it. Sets them on
    `cfg` (still defaults, as config.override sees them) and returns them as `key = value`s."""
    if not placement.apart:
        return []
    said = []
    for table, key, value in ((cfg.train, "max_staleness", 1), (cfg.serve, "sleep_level", 0),
                              (cfg.serve, "gpu_memory_utilization", 0.9)):
        if key not in table.model_fields_set:
            setattr(table, key, value)
            table.model_fields_set.discard(key)
            said.append(f"{'train' if table is cfg.train else 'serve'}.{key} = {value}")
    return said


def gpu_environment(gpus: tuple[int, ...], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a process given `gpus` (indices of the GPUs this process sees: under a
    CUDA_VISIBLE_DEVICES of its own, its entries); {} for a process without GPUs, which inherits the environment."""
    if not gpus:
        return {}
    seen = [x.strip() for x in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return {"CUDA_VISIBLE_DEVICES": ",".join(seen[g] if g < len(seen) else str(g) for g in gpus)}
