"""`lightning`: the command line. `lightning run` trains, `lightning check` says whether a run would train before
it does, `lightning eval` scores a policy on the eval tasks, `lightning traces` shows what the store holds,
`lightning worker` runs the agent for a remote run, `lightning serve` serves the model to a deployed app."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import tomllib
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lightning_sdk import config as config_mod
from lightning_sdk.console import configure_output, make_console, printable_lines
from lightning_sdk.distribution import DISTRIBUTION, VERSION, missing_train_extra
from lightning_sdk.evals import EVALS_DIR

EXIT_USAGE = 2  # click's convention for bad input


def _fail(console: Console, message: str, details: str | None = None) -> None:
    # escape: messages quote things like "pip install 'lightning-agent-rl[gpu]'", which rich would take for markup
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    if details:  # the user's own traceback (an agent module that failed to import), below the one line
        console.print(escape(details.rstrip()), highlight=False, soft_wrap=True, style="dim")
    sys.exit(EXIT_USAGE)


@click.group(context_settings={"max_content_width": 120})
@click.version_option(version=VERSION, package_name=DISTRIBUTION)
def main() -> None:
    """Train the LLM inside an existing agent with reinforcement learning."""
    configure_output()


SET_HELP = ("Override a config key, validated as in the file: --set train.lr=1e-4 (a TOML value; text that is "
            "not one is taken as a string). Repeatable.")


def _set_values(pairs: tuple[str, ...]) -> dict[str, Any]:
    """`--set KEY=VALUE` pairs as {key: value}, each value read as TOML (1e-4, true, "x", [1, 2]) or else text."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not eq or not key.strip():
            raise config_mod.ConfigError(f"--set {pair}: expected KEY=VALUE, e.g. --set train.lr=1e-4")
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw
    return out


def _load(config_path: Path, sets: tuple[str, ...]) -> config_mod.Config:
    """The config file with the --set overrides; a ConfigError names the key (and --set where it came from)."""
    cfg = config_mod.load(config_path)
    try:
        return config_mod.override(cfg, _set_values(sets))
    except config_mod.ConfigError as e:
        raise config_mod.ConfigError(f"--set: {e}") from None


@main.command(short_help='Train: serve the model, run the agent, update it; repeat (run.runtime: where the agent runs).')
@click.option("-c", "--config", "config_path", default="lightning.toml", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="The run's configuration.")
@click.option("--resume", is_flag=True, help="Continue the run in run.dir from its last checkpoint.")
@click.option("--overwrite", is_flag=True, help="Delete an existing run in run.dir and start over.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), help="Override run.dir.")
@click.option("--iterations", type=click.IntRange(min=1), help="Override run.iterations.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def run(config_path: Path, resume: bool, overwrite: bool, run_dir: Path | None, iterations: int | None,
        sets: tuple[str, ...]) -> None:
    """Train: serve the model, run the agent (here, on Ray or in `lightning worker`s: run.runtime), update it."""
    console = make_console()
    if resume and overwrite:
        _fail(console, "--resume and --overwrite exclude each other")
    try:
        cfg = _load(config_path, sets)
        if run_dir is not None:
            cfg.run.dir = run_dir
        if iterations is not None:
            cfg.run.iterations = iterations
    except config_mod.ConfigError as e:
        _fail(console, str(e))
    DatasetError, ModelLoadError, Runtime = _training_side(console, "lightning run")
    from lightning_sdk.errors import CaptureError, RunError, SetupError

    try:
        Runtime(cfg, resume=resume, overwrite=overwrite, console=console).run()
    except (DatasetError, ModelLoadError, SetupError) as e:
        _fail(console, str(e), getattr(e, "traceback", None))
    except (RunError, CaptureError) as e:
        console.print(f"[bold red]run stopped:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:  # after the update under way (if any) finished and saved its checkpoint
        console.print(f"interrupted: `lightning run --resume` continues {cfg.run.dir} after its last checkpoint "
                      f"(rollouts collected since are collected again)", highlight=False, soft_wrap=True)
        sys.exit(130)


@main.command(short_help='Run the agent once (nothing trained) and say whether it would train, and if not why.')
@click.option("-c", "--config", "config_path", default="lightning.toml", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="The run's configuration.")
@click.option("--tasks", default=2, show_default=True, type=click.IntRange(min=1),
              help="Tasks to run, each data.group_size times (the first iteration's).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def check(config_path: Path, tasks: int, sets: tuple[str, ...]) -> None:
    """Run the agent once through the run's server (nothing trained, nothing written) and say whether it would
    train: per rollout its LLM calls, what cannot train and why, reward and transitions.

    Exit status: 0 it would train and no rollout failed; 1 it would train nothing; 3 it would train, but some
    rollouts failed (the verdict names them; a run skips them)."""
    console = make_console()
    try:
        cfg = _load(config_path, sets)
    except config_mod.ConfigError as e:
        _fail(console, str(e))
    DatasetError, ModelLoadError, _ = _training_side(console, "lightning check")
    from lightning_sdk.check import check as preflight
    from lightning_sdk.errors import RunError, SetupError

    try:
        verdict = preflight(cfg, tasks=tasks, console=console)
    except (DatasetError, ModelLoadError, SetupError) as e:
        _fail(console, str(e), getattr(e, "traceback", None))
    except RunError as e:
        console.print(f"[bold red]check stopped:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    sys.exit(verdict.exit_code)


@main.command("eval", short_help='Score the base model or a trained adapter on the eval tasks.')
@click.option("-c", "--config", "config_path", default="lightning.toml", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="The run's configuration.")
@click.option("--trained", is_flag=True, help="Score the adapter (with [policies]: every policy's adapter) of the "
                                              "run's latest checkpoint (in run.dir).")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Score this checkpoint (checkpoints/iter-N) or PEFT adapter directory (with [policies]: a "
                   "directory holding one per policy, by name).")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), help="Override run.dir.")
@click.option("--data", "data_path", type=click.Path(path_type=Path),  # a directory: a datasets save_to_disk
              help="Eval tasks (default: data.eval).")
@click.option("--limit", type=click.IntRange(min=1), help="Score only the first N tasks.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def eval_(config_path: Path, trained: bool, checkpoint: Path | None, run_dir: Path | None,
          data_path: Path | None, limit: int | None, sets: tuple[str, ...]) -> None:
    """Score a policy on the eval tasks: the base model, or a trained adapter (--trained / --checkpoint). Says
    whether those are held-out or training tasks; the rollouts are kept in the run's evals/ folder."""
    console = make_console()
    if trained and checkpoint is not None:
        _fail(console, "--trained and --checkpoint exclude each other")
    try:
        cfg = _load(config_path, sets)
    except config_mod.ConfigError as e:
        _fail(console, str(e))
    if run_dir is not None:
        cfg.run.dir = run_dir
    DatasetError, ModelLoadError, Runtime = _training_side(console, "lightning eval")
    from lightning_sdk import data
    from lightning_sdk.dashboard.runs import STORE_FILE
    from lightning_sdk.errors import RunError, SetupError
    from lightning_sdk.train.checkpoint import (CHECKPOINTS, adapter_dir, checkpoint_iteration, checkpoint_of,
                                               latest_checkpoint, policy_adapters)

    path = data_path or cfg.data.eval
    if path is None:
        _fail(console, f"{config_path}: data.eval is not set; name the eval tasks with --data")
    adapter = None
    if trained:
        checkpoint = latest_checkpoint(Path(cfg.run.dir))
        if checkpoint is None:
            _fail(console, f"--trained: no checkpoint in {Path(cfg.run.dir) / 'checkpoints'}; run `lightning run` first")
    if checkpoint is not None and cfg.policies:  # every policy's adapter, each serving its components' calls
        names = sorted(cfg.policies)
        found = policy_adapters(checkpoint) or {n: checkpoint / n for n in names}
        if sorted(found) != names or not all((d / "adapter_config.json").exists() for d in found.values()):
            _fail(console, f"{checkpoint}: holds no adapter for each of [policies] {names} (a checkpoint's "
                           f"trainer/adapters/<policy>/, or a directory with one PEFT adapter per policy)")
        adapter = {n: found[n] for n in cfg.policies}  # in the config's order
    elif checkpoint is not None:
        adapter = checkpoint if (checkpoint / "adapter_config.json").exists() else adapter_dir(checkpoint)
        if not (adapter / "adapter_config.json").exists():
            _fail(console, f"--checkpoint {checkpoint}: neither a PEFT adapter directory nor a checkpoint holding one"
                  + ("; it holds one adapter per policy: the config needs their [policies]"
                     if policy_adapters(checkpoint) else ""))
    # The policy by the update that made it, and the run whose evals/ keeps the rollouts: the checkpoint's run, or
    # run.dir; none where that holds no run yet (an evals/ folder would make `lightning run` refuse the directory).
    made_by = checkpoint_of(checkpoint) if checkpoint is not None else None
    iteration = checkpoint_iteration(made_by) if made_by is not None else None
    run = made_by.parent.parent if made_by is not None and made_by.parent.name == CHECKPOINTS else Path(cfg.run.dir)
    keep = run / EVALS_DIR if (run / STORE_FILE).is_file() else None
    try:
        tasks = data.load(path)[:limit]
        done = Runtime(cfg, console=console).evaluate(tasks, adapter, iteration=iteration, keep=keep)
    except (DatasetError, ModelLoadError, SetupError) as e:
        _fail(console, str(e), getattr(e, "traceback", None))
    except RunError as e:
        console.print(f"[bold red]eval stopped:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(1)
    if adapter is None:
        policy = f"the base model {cfg.model.name} (untrained)"
    elif iteration is not None:
        policy = f"iteration {iteration} (checkpoint {made_by}, served as {done.policy})"
    else:
        policy = ("adapter " + str(adapter) if isinstance(adapter, Path)
                  else "adapters " + ", ".join(f"{k}: {v}" for k, v in adapter.items())) + f", served as {done.policy}"
    score = done.score
    console.print(f"{score.words} {score} over {score.n} tasks (mean reward ± standard error) of {policy}"
                  f"{score.failed_words}", highlight=False, soft_wrap=True, markup=False)
    console.print(f"eval rollouts: {done.store} (lightning traces --run-dir {run} --phase eval)" if done.store else
                  f"eval rollouts not kept: {run} holds no run", highlight=False, soft_wrap=True)


@main.command(short_help="Serve the model to a deployed app: every call recorded, rewards taken late (docs/serve.md).")
@click.option("-c", "--config", "config_path", default="lightning.toml", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="The configuration ([model], [serve]).")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path),
              help="Where calls, rewards and the key are kept (serve.sqlite, serve.key); default: run.dir/serve.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", default=0, show_default=True, type=click.IntRange(0, 65535), help="0 picks a free port.")
@click.option("--retention-days", default=30.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Feedback for calls older than this is refused (410); stored calls older than this are deleted "
                   "(kept while an unconsumed reward needs them).")
@click.option("--max-calls", type=click.IntRange(min=1, max=10**9),
              help="Keep at most this many stored calls: the oldest beyond it are deleted (but those an unconsumed "
                   "reward needs); default: no cap.")
@click.option("--store-text/--no-store-text", default=None,
              help="Keep each call's message text (for the dashboard and `lightning traces`), or only the token ids, "
                   "log-probs and settings training reads; default: serve.store_text (true).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
def serve(config_path: Path, directory: Path | None, host: str, port: int, retention_days: float,
          max_calls: int | None, store_text: bool | None, sets: tuple[str, ...]) -> None:
    """Serve the model behind an OpenAI-compatible address until Ctrl-C or SIGTERM; the key is
    LIGHTNING_SERVE_KEY, else serve.api_key, else the one kept in the directory's serve.key."""
    console = make_console()
    try:
        cfg = _load(config_path, sets)
    except config_mod.ConfigError as e:
        _fail(console, str(e))
    if store_text is not None:
        cfg.serve.store_text = store_text
    from lightning_sdk.errors import ServerError, SetupError
    from lightning_sdk.production import deployment

    scorer = None
    if cfg.learn is not None:  # the gate's tasks, read (and checked) before anything starts or is written
        from lightning_sdk import data
        from lightning_sdk.production.promotion import eval_scorer

        try:
            scorer = eval_scorer(cfg)
        except data.DatasetError as e:
            _fail(console, f"data.eval: {e}")
    directory = directory or cfg.run.dir / "serve"
    try:
        served = deployment.start(cfg, directory, host=host, port=port, api_key=os.environ.get("LIGHTNING_SERVE_KEY"),
                                  retention_s=retention_days * 86400, scorer=scorer, max_calls=max_calls)
    except OSError as e:
        _fail(console, f"--host/--port: cannot listen on {host}:{port} ({e.strerror or e})")
    except ServerError as e:
        _fail(console, f"the inference server did not start: {e}")
    except SetupError as e:
        _fail(console, str(e))
    console.print(f"serving {cfg.model.name} at {served.url}/v1 (key: LIGHTNING_SERVE_KEY or "
                  f"{directory / deployment.KEY_FILE}); feedback: POST {served.url}/v1/feedback; "
                  f"calls and rewards: {served.store.path}" + ("" if cfg.serve.store_text else " (no message text)"),
                  highlight=False, soft_wrap=True, markup=False)
    placed = served.placement_line()
    if placed:
        console.print(placed, highlight=False, soft_wrap=True, markup=False)
    if served.schedule is not None:
        console.print(f"learning: an update every {cfg.learn.every_rewarded} rewards, each candidate gated on "
                      f"{cfg.data.eval}; serving now: {served.gateway.policy}", highlight=False, soft_wrap=True,
                      markup=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    served.close()


@main.command(short_help="List recent rollouts with reward and LLM calls, or one rollout's spans.")
@click.option("-c", "--config", "config_path", default="lightning.toml", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="Find the store through this run's run.dir.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="A run directory, or a folder of runs (default: run.dir in --config).")
@click.option("-n", "--limit", default=20, show_default=True, type=click.IntRange(min=1),
              help="Rollouts to list, newest first (per store).")
@click.option("--rollout", "rollout_id", help="Show one rollout's spans.")
@click.option("--status", type=click.Choice(["running", "succeeded", "failed", "abandoned", "untrained"]),
              help="Only rollouts with this status.")
@click.option("--phase", type=click.Choice(["train", "eval"]),
              help="Only training or eval rollouts (eval: also those of `lightning eval`, kept in evals/).")
@click.option("--checkpoint", help="Only the rollouts this checkpoint's update trained on (iter-00003, or a path).")
def traces(config_path: Path, run_dir: Path | None, limit: int, rollout_id: str | None, status: str | None,
           phase: str | None, checkpoint: str | None) -> None:
    """List recent rollouts with their reward and LLM calls (or one rollout's spans); a run's store, then the
    stores of its `lightning eval`s."""
    from lightning_sdk.store import Store

    console = make_console()
    if run_dir is None:
        try:
            run_dir = config_mod.load(config_path).run.dir
        except config_mod.ConfigError as e:
            _fail(console, f"{e} (or pass --run-dir)")
    stores = _stores(Path(run_dir))
    if not stores:
        _fail(console, f"no store at {Path(run_dir) / 'store.sqlite'}, nor in a run below it")
    if rollout_id:
        for db in stores:
            with Store(db, read_only=True) as store:  # a reader never writes to the run, not even its mtime
                record = store.rollout(rollout_id)
                if record is not None:
                    _show_rollout(console, store, record)
                    return
        _fail(console, f"no rollout {rollout_id!r} in " + ", ".join(map(str, stores)))
    for db in stores:
        if checkpoint is not None and db.parent.name == EVALS_DIR:
            continue  # `lightning eval` trains nothing
        with Store(db, read_only=True) as store:
            _list_rollouts(console, store, db, limit, status, phase, checkpoint)


def _stores(run_dir: Path) -> list[Path]:
    """The run's store, or those of the runs in a folder of runs (found as the dashboard finds them); each followed
    by the stores its `lightning eval`s kept in evals/, oldest first."""
    from lightning_sdk.dashboard.runs import STORE_FILE, discover

    runs = [run_dir] if (run_dir / STORE_FILE).is_file() else [run for run in discover(run_dir)
                                                                 if (run / STORE_FILE).is_file()]
    return [db for run in runs for db in [run / STORE_FILE, *sorted((run / EVALS_DIR).glob("[!.]*.sqlite"))]]


def _show_rollout(console: Console, store: Any, record: Any) -> None:
    """One rollout: what it was, its task (expected answer included), then each span; an LLM call with its whole
    conversation, shown once."""
    from lightning_sdk.tracing.records import is_llm_call

    reward = "no reward" if record.reward is None else f"reward {record.reward:.3f}"
    took = "" if record.seconds is None else f", {record.seconds:.2f} s"
    # Agent and worker text: an escape sequence in it must not drive the terminal.
    say = lambda line: console.print(printable_lines(line), highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    say(f"rollout {record.rollout_id} ({record.phase}, iteration {record.iteration}, attempt {record.attempt}): "
        f"{record.status}, {reward}, policy {record.model or 'unknown'}{took}")
    if record.error:
        say(f"  error: {record.error}")
    task = store.task(record.task_id)
    say(f"task {record.task_id}" + ("" if task is not None else " (not stored)"))
    for key, value in (task or {}).items():
        text = value if isinstance(value, str) else json.dumps(value)
        say(f"  {key}: " + text.replace("\n", "\n" + " " * (len(key) + 4)))
    calls = 0
    for span in store.spans(record.rollout_id):
        if is_llm_call(span):
            calls += 1
            say(f"LLM call {calls}: " + describe(span))
            for role, text in conversation(span.attributes):  # every prompt turn, then the reply
                say(f"  {role:>9}: " + text.replace("\n", "\n" + " " * 13))
        else:
            say(describe(span))


def _list_rollouts(console: Console, store: Any, db: Path, limit: int, status: str | None, phase: str | None,
                   checkpoint: str | None) -> None:
    from lightning_sdk.train.checkpoint import checkpoint_name, completed_iterations, trained_into

    run_dir = db.parent
    completed = completed_iterations(Path(run_dir))
    title = f"{db}: {store.count('rollouts')} rollouts, {store.count('spans')} spans"
    if checkpoint is None:
        rows = store.rollouts(phase=phase, status=status, limit=limit, newest_first=True)
    else:
        name = Path(checkpoint).name
        n = next((k for k in range(1, completed + 1) if checkpoint_name(k) == name), None)
        if n is None:
            _fail(console, f"--checkpoint {checkpoint}: no update of this run made it (expected iter-NNNNN, at most "
                           f"{checkpoint_name(completed)})" if completed else
                  f"--checkpoint {checkpoint}: no update of this run has completed yet")
        rows = [r for r in store.rollouts(phase="train", iteration=n, status=status, newest_first=True)
                if phase in (None, "train") and trained_into(r.phase, r.iteration, r.status, completed) == name]
        title += f"; the {len(rows)} rollouts {name} trained on"
        rows = rows[:limit]
    if not rows:
        wanted = " and ".join(f for f in (phase and f"phase {phase}", status and f"status {status}",
                                          checkpoint and f"trained into {Path(checkpoint).name}") if f)
        console.print(f"{db}: no rollouts" + (f" with {wanted}" if wanted else " yet"), highlight=False,
                      soft_wrap=True)
        return
    calls = store.call_counts([r.rollout_id for r in rows])
    table = Table(title=title)
    for col in ("rollout", "phase", "iter", "status", "reward", "calls", "seconds", "trained into", "error"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.rollout_id, r.phase, str(r.iteration), r.status,
                      "" if r.reward is None else f"{r.reward:.3f}", str(calls.get(r.rollout_id, 0)),
                      "" if r.seconds is None else f"{r.seconds:.2f}",
                      trained_into(r.phase, r.iteration, r.status, completed) or "", (r.error or "")[:60])
    console.print(table)


@main.command(short_help='Serve a read-only web page of runs (open it with the printed key).')
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="A run directory, or a folder of runs (default: the parent of run.dir in --config, else runs).")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Credit rewards to LLM calls with this config's rollout.credit / components / error_reward.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", default=8321, show_default=True, type=click.IntRange(0, 65535), help="0 picks a free port.")
def dashboard(run_dir: Path | None, config_path: Path | None, host: str, port: int) -> None:
    """Serve a read-only web page of runs: rewards, iterations, rollouts, each LLM call (needs the printed key)."""
    console = Console()
    try:
        from lightning_sdk.dashboard import CreditSettings, RunReader, bind, new_token, serve
    except ImportError as e:
        _fail(console, missing_train_extra(e, "lightning dashboard") or str(e))
    settings, reward_name = CreditSettings(), "reward"
    if config_path is not None:
        try:
            cfg = config_mod.load(config_path)
        except config_mod.ConfigError as e:
            _fail(console, str(e))
        r = cfg.rollout
        trained = [c for p in config_mod.policies(cfg) for c in p.components]  # every policy's, as the runtime's
        settings = CreditSettings(rule=r.credit, components=tuple(trained), error_reward=r.error_reward,
                                  scale=cfg.train.scale_rewards, failed_reward=r.failed_reward,
                                  drop_zero_variance=cfg.train.drop_zero_variance_groups, source=str(config_path))
        reward_name = cfg.learn.reward_name if cfg.learn is not None else reward_name
        run_dir = run_dir or Path(cfg.run.dir).parent
    run_dir = run_dir or Path("runs")
    if not run_dir.is_dir():
        _fail(console, f"--run-dir {run_dir}: no such directory (a run directory or a folder of runs)")
    try:
        reader = RunReader(run_dir, settings, reward_name)
    except ValueError as e:
        _fail(console, str(e))
    try:
        sock = bind(host, port)
    except OSError as e:
        _fail(console, f"--host {host} --port {port}: cannot listen ({e.strerror})")
    token = new_token()
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/?token={token}"
    console.print(f"dashboard of {reader.root} at {url}  (read-only; Ctrl-C stops it)", highlight=False,
                  soft_wrap=True)
    serve(reader, sock, token)


def _training_side(console: Console, what: str) -> tuple[type, type, type]:
    """DatasetError, ModelLoadError and Runtime: imported here, where a missing `train` extra is one line, exit 2."""
    try:
        from lightning_sdk.data import DatasetError
        from lightning_sdk.models import ModelLoadError
        from lightning_sdk.runtime import Runtime
    except ImportError as e:
        line = missing_train_extra(e, what)
        if line is None:
            raise
        _fail(console, line)
    return DatasetError, ModelLoadError, Runtime


@main.command(short_help='Run the agent for a remote run (run.runtime = "remote" or "processes").')
@click.argument("module", required=False)
@click.option("--server", help="The run's URL, as `lightning run` printed it (env LIGHTNING_SERVER).")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path),
              help="The run directory's worker.token (or env LIGHTNING_TOKEN holding the token).")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path),
              help="A run's directory on this machine: its server.json and worker.token.")
@click.option("--concurrency", default=8, show_default=True, type=click.IntRange(min=1),
              help="Rollouts at once.")
@click.option("--rollout", help="The @rollout function's name, if the module has several.")
@click.option("--reward", help="The @reward function's name, if the module has several.")
def worker(module: str | None, server: str | None, token_file: Path | None, run_dir: Path | None, concurrency: int,
           rollout: str | None, reward: str | None) -> None:
    """Run the agent for a remote run (run.runtime = "remote"), here in its own folder and environment.

    MODULE is the agent's .py file or dotted module (default: [agent] module of ./lightning.toml).
    """
    from lightning_sdk.rollouts.remote import worker as client
    from lightning_sdk.errors import RunError, SetupError

    console = make_console()
    try:
        worker = client.Worker(client.settings(module=module, server=server, token_file=token_file, run_dir=run_dir,
                                               concurrency=concurrency, rollout=rollout, reward=reward), console)
        console.print(worker.run(), highlight=False, soft_wrap=True)
        sys.exit(worker.exit_code)  # 0 when the run is over; 130 / 143 when Ctrl-C / SIGTERM stopped it
    except SetupError as e:
        _fail(console, str(e), getattr(e, "traceback", None))
    except RunError as e:
        console.print(f"[bold red]worker stopped:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:  # a Ctrl-C while the settings are read: nothing claimed
        console.print("worker stopped (Ctrl-C)", highlight=False, soft_wrap=True)
        sys.exit(130)


STATUS_WORDS = {"OK": "ok", "ERROR": "failed", "UNSET": ""}  # UNSET: the span ended without saying; nothing to add


def describe(record: Any) -> str:
    """One line for a span in `lightning traces --rollout`; an LLM call's text is shown by `conversation`."""
    from lightning_sdk.tracing.records import COMPLETION_IDS, PROMPT_IDS, REWARD_NAME, REWARD_SPAN, REWARD_VALUE

    a = record.attributes
    if record.name == REWARD_SPAN:
        return f"intermediate reward {a.get(REWARD_NAME)} = {a.get(REWARD_VALUE)}"
    status = STATUS_WORDS.get(record.status, record.status.lower())
    if record.status_message:
        status += f": {record.status_message}"
    seconds = (record.end_ns - record.start_ns) / 1e9
    parts = [record.name, f"component {record.component}" if record.component else "no component"]
    if PROMPT_IDS in a or COMPLETION_IDS in a:
        parts.append(f"{len(a.get(PROMPT_IDS) or [])} prompt -> {len(a.get(COMPLETION_IDS) or [])} completion tokens")
    parts.append(f"{seconds:.2f} s")
    return ", ".join(parts) + (f", {status}" if status else "")


def conversation(attrs: dict[str, Any]) -> list[tuple[str, str]]:
    """An LLM call's messages as (role, text): the system instructions, the prompt (system, user, assistant and
    tool turns), then the completion (role "assistant" shown as "→ reply")."""
    from lightning_sdk.tracing.records import TEXT, TEXT_NOT_STORED, messages

    if attrs.get(TEXT) == TEXT_NOT_STORED:
        return [("text", "not stored (serve.store_text = false): token ids and log-probs only")]
    out = []
    raw = attrs.get("gen_ai.system_instructions")  # a list of parts, not of messages
    if raw:
        try:
            out.append(("system", "\n".join(_part_text(p) for p in json.loads(raw))))
        except (TypeError, ValueError):
            out.append(("gen_ai.system_instructions", str(raw)))
    for direction in ("input", "output"):
        for m in messages(attrs, direction):
            role = "→ reply" if direction == "output" else str(m.get("role", "?"))
            out.append((role, "\n".join(_part_text(p) for p in m.get("parts") or [])))
    return out


def _part_text(part: Any) -> str:
    if not isinstance(part, dict):
        return str(part)
    kind = part.get("type")
    if kind == "tool_call":
        return f"<tool call {part.get('name')}({json.dumps(part.get('arguments'))}) id={part.get('id')}>"
    if kind == "tool_call_response":
        return f"<tool result id={part.get('id')}> {part.get('response')}"
    if "content" in part:
        return str(part["content"])
    return json.dumps(part)


if __name__ == "__main__":
    main()
