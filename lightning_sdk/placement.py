"""Placement, in one place: which of the visible GPUs each inference server and the trainer get, from the config
and the number of GPUs this process sees. A pure function, so it is tested without GPUs; the processes get their
GPUs through CUDA_VISIBLE_DEVICES (`gpu_environment`), never by reaching into another library.

The default on N visible GPUs: one GPU is shared in turns, as it always was (vLLM sleeps during each update); two
or more are split, about half serving (inference is most of an agent run's time) and the rest training, and the
two sides then overlap (train.max_staleness = 1, where the config does not say). The trainer runs one
data-parallel process per GPU it is given (train.processes, where the config does not say), so every visible GPU
works; a GPU the config leaves without work is named in the placement's line, with the reason."""

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
    processes: int = 1  # trainer processes: one per GPU of `train` unless train.processes says otherwise
    idle: str = ""  # the GPUs nothing runs on, and why ("" when every visible GPU works)
    vllm: bool = False  # the servers are vLLM (serve.sleep_level and serve.gpu_memory_utilization are its)

    @property
    def serving(self) -> tuple[int, ...]:
        return tuple(g for r in self.replicas for g in r)

    @property
    def training(self) -> tuple[int, ...]:
        """The GPUs the trainer's processes run on: one each, the first of `train`."""
        return self.train[:self.processes]

    @property
    def shared(self) -> bool:
        """Serving and training on the same GPUs, in turns."""
        return bool(set(self.serving) & set(self.train))

    @property
    def apart(self) -> bool:
        """Serving and training on GPUs of their own, at once."""
        return bool(self.serving) and bool(self.train) and not self.shared

    def line(self, turns: str | None = None, implied: list[str] | None = None) -> str:
        """The placement in one line, for the run's first lines. Apart, collection and update run at once
        (pipelined) unless `turns` says why they take turns (turns_note); `implied`: the defaults it sets."""
        n = len(self.replicas)
        servers = (f"{n} inference server{'s' if n > 1 else ''} on "
                   + ("the CPU" if not self.serving else "; ".join(_gpus(r) for r in self.replicas))) if n else \
            "the inference servers where Ray places them"
        k = self.processes
        trainer = (f"the trainer on {_gpus(self.training)}" + (f" ({k} data-parallel processes)" if k > 1 else "")
                   if self.train else "the trainer on the CPU/train.device")
        how = (", in turns (the server sleeps during each update)" if self.shared else
               "" if not self.apart else f", in turns ({turns})" if turns else ", at once (pipelined)")
        so = f"; so {', '.join(implied)}" if implied else ""
        idle = f"; {self.idle}" if self.idle else ""
        return f"placement: {self.visible} GPU(s) visible; {servers}, {trainer}{how}{so}{idle}"


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
    everything = tuple(range(visible))
    if cfg.run.runtime == "ray":
        # Ray places the servers (ray.servers, ray.gpus_per_server), on this machine's GPUs too where its cluster
        # has them: the trainer here takes only the GPUs train.processes asks for, the rest are Ray's.
        procs = cfg.train.processes
        if train_gpu and procs > visible:
            raise SetupError(f"train.processes = {procs} takes one GPU each; only {visible} GPU(s) are visible")
        train = everything[:procs] if train_gpu else ()
        rest = everything[len(train):]
        return Placement((), train, visible, procs,
                         f"{_gpus(rest)} left to Ray: with run.runtime = 'ray' the trainer takes train.processes = "
                         f"{procs} GPU{'s' if procs > 1 else ''} (set it to train on more)" if rest else "")
    serve_gpu = visible > 0 and (backend == "vllm" or s.device.startswith("cuda"))
    serve = _pinned(d.serve, s.device, serve_gpu)
    train = _pinned(d.train, cfg.train.device, train_gpu)
    left = ""  # why the servers leave GPUs to nobody, where they do
    if serve is None and train is None:  # the split: on one GPU, both there; else the first share serves
        if not serve_gpu:  # the built-in server on the CPU: every GPU the trainer's
            serve, train = (), everything if train_gpu else ()
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
        if not serve_gpu:
            left = ("the built-in server is on the CPU (serve.device = 'cpu') and the trainer has only "
                    + ("devices.train" if d.train is not None else f"train.device = {cfg.train.device!r}"))
    elif train is None:
        rest = tuple(g for g in everything if g not in serve)
        train = (rest or serve) if train_gpu else ()
    else:
        left = "neither devices.serve nor devices.train names them" if d.serve is not None or d.train is not None \
            else "serve.device and train.device each name one GPU"
    if serve and len(serve) < tp:
        raise SetupError(f"serve.tensor_parallel_size = {tp}: the servers have {len(serve)} GPU(s) ({list(serve)})")
    n = s.replicas or (len(serve) // tp if serve else 1)
    if serve and n * tp > len(serve):
        raise SetupError(f"serve.replicas = {n} x serve.tensor_parallel_size = {tp}: needs {n * tp} GPUs; the "
                         f"servers have {len(serve)} ({list(serve)}); set devices.serve or fewer replicas")
    procs = _processes(cfg, train)
    if train and len(train) < procs:
        raise SetupError(f"train.processes = {procs} takes one GPU each; the trainer has {len(train)} "
                         f"({list(train)}): set devices.train to {procs} GPUs or fewer processes")
    replicas = tuple(serve[i * tp:(i + 1) * tp] for i in range(n)) if serve else ((),) * n
    if not serve_gpu and not train_gpu:
        left = (f"the built-in server and the trainer are on the CPU (serve.device = {s.device!r}, train.device = "
                f"{cfg.train.device!r})")
    elif not left:
        left = "; ".join(([f"serve.replicas = {n} x serve.tensor_parallel_size = {tp} serve on {n * tp} GPU"
                           f"{'s' if n * tp > 1 else ''}"
                           if s.replicas else f"each replica takes serve.tensor_parallel_size = {tp} GPUs"]
                          if serve_gpu else [])
                         + ([] if train_gpu else [f"the trainer is on the CPU (train.device = {cfg.train.device!r})"]))
    return Placement(replicas, tuple(train), visible, procs,
                     _idle(cfg, tuple(g for r in replicas for g in r), tuple(train), procs, everything, left),
                     backend == "vllm")


def _processes(cfg: Config, train: tuple[int, ...]) -> int:
    """The trainer's processes: train.processes where the config sets it (or where the trainer has no GPUs, or a
    train.device that names one); else one per GPU it is given, each a data-parallel rank (train/ranks.py)."""
    t = cfg.train
    if "processes" in t.model_fields_set or not train or t.device not in ("auto", "cuda"):
        return t.processes
    return len(train)


def _idle(cfg: Config, serving: tuple[int, ...], train: tuple[int, ...], procs: int, everything: tuple[int, ...],
          left: str) -> str:
    """The words for the GPUs nothing runs on: those the trainer is given beyond its processes, and those neither
    side is given (`left` says why); "" when there are none."""
    spare = tuple(g for g in train[procs:] if g not in serving)
    unused = tuple(g for g in everything if g not in serving and g not in train)
    said = []
    if spare:
        said.append(f"{_gpus(spare)} idle: train.processes = {procs} is set, "
                    + ("one trainer process on one GPU" if procs == 1 else f"{procs} trainer processes of one GPU each")
                    + " (unset: one per trainer GPU)"
                    if cfg.train.device in ("auto", "cuda") else
                    f"{_gpus(spare)} idle: train.device = {cfg.train.device!r} names one GPU")
    if unused:
        said.append(f"{_gpus(unused)} idle: {left}")
    return "; ".join(said)


def _gpus(ids: tuple[int, ...]) -> str:
    return f"GPU{'s' if len(ids) > 1 else ''} {','.join(map(str, ids))}"


def _pinned(ids: list[int] | None, device: str, on_gpu: bool) -> tuple[int, ...] | None:
    """The GPUs a side is pinned to: [devices], else a 'cuda:N' device; None when free to place."""
    if ids is not None:
        return tuple(ids)
    if on_gpu and device.startswith("cuda:"):
        return (int(device.partition(":")[2]),)
    return None


def defaults_for(cfg: Config, placement: Placement) -> list[str]:
    """What the placement implies, each where the config does not set it: one trainer process per GPU the trainer
    is given (train.processes); apart, vLLM awake (serve.sleep_level = 0) with most of its GPUs' memory
    (serve.gpu_memory_utilization = 0.9) and, vLLM awake, serving and training overlapping (train.max_staleness =
    1). A serve.sleep_level = 1 the config sets apart is kept, and the two then take turns (`turns_note`). Sets
    them on `cfg` (still defaults, as config.override sees them) and returns them as `key = value`s."""
    implied = [(cfg.train, "processes", placement.processes)]
    awake = not placement.vllm or cfg.serve.sleep_level == 0 or "sleep_level" not in cfg.serve.model_fields_set
    if placement.apart and placement.vllm:
        implied += [(cfg.serve, "sleep_level", 0), (cfg.serve, "gpu_memory_utilization", 0.9)]
    if placement.apart and awake:
        implied.append((cfg.train, "max_staleness", 1))
    said = []
    for table, key, value in implied:
        if key not in table.model_fields_set and getattr(table, key) != value:
            setattr(table, key, value)
            table.model_fields_set.discard(key)
            said.append(f"{'train' if table is cfg.train else 'serve'}.{key} = {value}")
    return said


def turns_note(cfg: Config, placement: Placement) -> str | None:
    """Apart, why collection and update take turns (the config keeps train.max_staleness at 0, or sets
    serve.sleep_level = 1, which keeps it there); None where they overlap or share the GPUs anyway."""
    if not placement.apart or cfg.train.max_staleness:
        return None
    if placement.vllm and cfg.serve.sleep_level and "sleep_level" in cfg.serve.model_fields_set:
        return ("serve.sleep_level = 1 is set: vLLM sleeps during each update, which GPUs of its own do not need; "
                "serve.sleep_level = 0 overlaps them, train.max_staleness = 1")
    return "train.max_staleness = 0 is set"


def settle(cfg: Config, placement: Placement) -> str | None:
    """The defaults `placement` implies set on `cfg` (defaults_for), and the line that says both, for the run's first
    lines; None on the CPU with one server: nothing to say."""
    implied = defaults_for(cfg, placement)
    if not (placement.serving or placement.train or len(placement.replicas) > 1 or placement.idle):
        return None
    return placement.line(turns_note(cfg, placement), implied)


def trainer_device(device: str, gpus: tuple[int, ...]) -> str:
    """The device of a trainer process given `gpus` (the placement's train GPUs): the first of them where
    train.device (`device`) leaves the choice to the placement ('auto', 'cuda'); else `device` as set."""
    return f"cuda:{gpus[0]}" if gpus and device in ("auto", "cuda") else device


def gpu_environment(gpus: tuple[int, ...], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a process given `gpus` (indices of the GPUs this process sees: under a
    CUDA_VISIBLE_DEVICES of its own, its entries); {} for a process without GPUs, which inherits the environment."""
    if not gpus:
        return {}
    seen = [x.strip() for x in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return {"CUDA_VISIBLE_DEVICES": ",".join(seen[g] if g < len(seen) else str(g) for g in gpus)}


def lines_for(cfg_path: str, counts: tuple[int, ...] = (1, 2, 4, 8)) -> list[str]:
    """The placement line of the config at `cfg_path` on each of `counts` GPUs (serve.backend 'auto' as on a GPU
    machine with vLLM: 'vllm'), or the refusal's words: what a run there would say, nothing started."""
    from lightning_sdk.config import load

    out = []
    for n in counts:
        cfg = load(cfg_path)
        backend = "vllm" if cfg.serve.backend == "vllm" or (cfg.serve.backend == "auto" and n) else "cpu"
        try:
            out.append(f"{n} GPU(s): {settle(cfg, place(cfg, visible=n, backend=backend))}")
        except SetupError as e:
            out.append(f"{n} GPU(s): refused: {e}")
    return out


def main(argv: list[str]) -> int:
    """python -m lightning_sdk.placement [CONFIG] [N ...]: the lines on N GPUs (1 2 4 8); bad input: one line on
    stderr, exit 2."""
    import sys

    from lightning_sdk.config import ConfigError

    path, given = (argv[0] if argv else "lightning.toml"), argv[1:]
    bad = next((n for n in given if not (n.isascii() and n.isdigit())), None)
    if bad is not None:
        print(f"python -m lightning_sdk.placement: N = {bad!r}: expected a number of GPUs (0, 1, 2, ...)",
              file=sys.stderr)
        return 2
    try:
        lines = lines_for(path, tuple(map(int, given)) or (1, 2, 4, 8))
    except ConfigError as e:
        print(f"python -m lightning_sdk.placement: CONFIG: {e}".replace("\n", " "), file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
