"""Scoring a policy on held-out tasks: each task once, seeded per task, in the run (untrained and trained) and in
`lightning eval`, whose rollouts go to a store of their own."""

from __future__ import annotations

import tempfile
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from lightning_sdk import data
from lightning_sdk.config import Config
from lightning_sdk.evals import EvalScore, eval_seed, split_of
from lightning_sdk.files import new_file
from lightning_sdk.rollouts.job import RolloutJob
from lightning_sdk.runtime.session import Session, store_session
from lightning_sdk.store import eval_score, seal


@dataclass(frozen=True)
class Evaluated:
    """What `Runtime.evaluate` scored: the score, the served policy's name, and the store file its rollouts were
    kept in (None: a throwaway store)."""

    score: EvalScore
    policy: str
    store: Path | None
    scores: list[float]  # each task's score, in the order of the tasks given (what a paired comparison reads)


def score(session: Session, tasks: list[dict], policy: dict[str, str], label: str, split: tuple[str, int],
          iteration: int | None = None, *, say: bool = True, run_seed: int | None = None) -> EvalScore:
    """Each task once under `policy`; rollouts stored with phase 'eval' at `iteration` (default: 0 untrained,
    run.iterations trained), each sampling with its task's seed (evals.eval_seed of `run_seed`, default run.seed).
    `say`: print the score line (`lightning eval` prints its own)."""
    cfg = session.cfg
    seeded = cfg.run.seed if run_seed is None else run_seed
    phase_it = iteration if iteration is not None else 0 if label == "untrained" else cfg.run.iterations
    jobs = [RolloutJob(rollout_id=f"eval-{label}-{i:04d}-{uuid.uuid4().hex[:8]}", task_id=data.task_id(t),
                       group_id=f"eval:{label}:{i}", task=t, iteration=phase_it, phase="eval",
                       seed=eval_seed(seeded, data.task_id(t)))
            for i, t in enumerate(tasks)]
    results = session.collect(jobs, policy, f"eval ({label})")
    failed = sum(r.status != "succeeded" for r in results)
    out = EvalScore.of([eval_score(r.reward) for r in results], *split, failed=failed,
                       failures=session.failures(results) if failed else "")
    if say:
        session.console.print(f"eval ({label}, {session.label(policy)}): {out.words} {out} over {out.n} tasks "
                              f"(mean reward ± standard error){out.failed_words}", highlight=False,
                              soft_wrap=True, markup=False)
    return out


def evaluate(cfg: Config, console: Console, credit_rule: Any, tasks: list[dict],
             adapter: Path | dict[str, Path] | None = None, *, iteration: int | None = None,
             keep: Path | None = None, resume: bool = False) -> Evaluated:
    """Score the base model, or the base with `adapter` (a PEFT directory; with [policies], one per policy, each
    serving its components' calls), on `tasks`: `lightning eval`. `iteration`: the update that made the adapter,
    which names it (`<run>-iter<N>`) and the rollouts' iteration (0 for the base model).

    The rollouts go to a store of their own, never the run's (which a running run owns, and whose eval scores the
    dashboard reads per iteration): with `keep` (a run's evals/ folder) a new file there,
    `<UTC time>-iter<N>.sqlite`, that appears only complete and never replaces one; else a throwaway store.
    """
    split = split_against_train(cfg, tasks)
    tag = "untrained" if adapter is None else f"iter{iteration}" if iteration is not None else "adapter"
    with ExitStack() as stack:
        if keep is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lightning-scratch-")))
            db = folder / "store.sqlite"
        else:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            kept = stack.enter_context(new_file(keep, f"{stamp}-{tag}", ".sqlite"))
            db, folder = kept.tmp, Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lightning-eval-")))
        with store_session(cfg, console, tasks, db, folder, credit_rule, run_dir=Path(cfg.run.dir),
                           resume=resume) as session:
            policy = serve_adapter(session, adapter, tag)
            label = "trained" if adapter is not None else "untrained"
            scored = score(session, tasks, policy, label, split, iteration=0 if adapter is None else iteration or 0,
                           say=False)
            served = session.label(policy)
            per_task = task_scores(session.store.rollouts(phase="eval"), label)
        if keep is not None:
            seal(db)  # before it appears: readers of it then write nothing beside it
    return Evaluated(scored, served, kept.path if keep is not None else None, per_task)


def paired(cfg: Config, credit_rule: Any, tasks: list[dict], sides: list[tuple[Path | None, int]],
           run_seed: int, *, server: Any = None) -> list[list[float]]:
    """Each side (a PEFT directory or None for the base model, and the version that names it) scored on `tasks`
    in one throwaway session, every side with the same seeds (evals.eval_seed of `run_seed`): one score per task,
    in task order, per side. `server`: a running inference server to score on (servers.lent.LentServer: the
    sides' adapters are loaded into it and unloaded after), else the session starts one of its own."""
    split = split_against_train(cfg, tasks)
    quiet = Console(quiet=True)
    with tempfile.TemporaryDirectory(prefix="lightning-scratch-") as tmp, \
            store_session(cfg, quiet, tasks, Path(tmp) / "store.sqlite", Path(tmp), credit_rule,
                          run_dir=Path(cfg.run.dir), resume=False, server=server) as session:
        out = []
        for k, (adapter, version) in enumerate(sides):
            label = f"side{k}"
            score(session, tasks, serve_adapter(session, adapter, f"iter{version}"), label, split,
                  iteration=version, say=False, run_seed=run_seed)
            out.append(task_scores(session.store.rollouts(phase="eval"), label))
    return out


def split_against_train(cfg: Config, tasks: list[dict]) -> tuple[str, int]:
    """Whether `tasks` are held out from data.train (evals.split_of)."""
    train = data.load(cfg.data.train, cfg.data.required_fields)
    return split_of(map(data.task_id, tasks), map(data.task_id, train))


def serve_adapter(session: Session, adapter: Path | dict[str, Path] | None, tag: str) -> dict[str, str]:
    """The policy that serves `adapter` (one per [policies] entry, or None: the base model), hot-loaded as
    `<run>-<tag>` (`<run>-<policy>-<tag>` with [policies])."""
    name = session.cfg.run.name
    policy = {p.name: session.base for p in session.policies}
    adapters = {name: adapter} if isinstance(adapter, Path) else adapter or {}
    for policy_name, path in adapters.items():
        policy[policy_name] = f"{name}-{tag}" if not session.multi else f"{name}-{policy_name}-{tag}"
        session.collector.hot_load(policy[policy_name], path)
    return policy


def task_scores(rollouts: list, label: str) -> list[float]:
    """The scores of the eval rollouts `score` made under `label`, in task order (their group ids are
    `eval:<label>:<task index>`)."""
    mine = [r for r in rollouts if r.group_id.rsplit(":", 1)[0] == f"eval:{label}"]
    return [eval_score(r.reward) for r in sorted(mine, key=lambda r: int(r.group_id.rsplit(":", 1)[1]))]
