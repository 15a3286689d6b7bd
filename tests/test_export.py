"""A run's spans reach the user's own tools: a real OTLP/HTTP receiver on 127.0.0.1 (decoding the protobuf the
exporter sends), the application's own global TracerProvider, and the trackers of `run.report_to` (TensorBoard,
MLflow's file store, W&B offline), which get the eval scores as metrics.jsonl does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

import lightning_sdk as ls
from lightning_sdk import metric_names as names
from lightning_sdk.dashboard.runs import RunReader
from lightning_sdk.rollouts.job import RolloutJob
from lightning_sdk.store import Store
from lightning_sdk.tracing import COMPLETION_IDS, REWARD_SPAN, REWARD_VALUE

from .conftest import SERVED, rollouts_to_collector

ROOT = Path(__file__).resolve().parents[1]


def test_rollout_spans_go_to_an_otlp_receiver_with_their_rollout_ids(gateway_server, tmp_path, receiver):
    """The rollout's own span (the root), the gateway's record of each call (once: the OpenAI client's own span
    would repeat it) and the reward: one tree per rollout at the collector, the same spans as in the store."""
    store = Store(tmp_path / "store.sqlite")
    gw = gateway_server

    @ls.rollout
    async def agent(task, llm):
        async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
            with ls.component("solver"):
                out = await client.chat.completions.create(model=llm.model, max_tokens=3,
                                                           messages=[{"role": "user", "content": task["q"]}])
            ls.emit_reward(0.25, name="format")
        return out.choices[0].message.content

    @ls.reward
    def score(task, output):
        return 1.0

    jobs = [RolloutJob(rollout_id=f"otlp-{k}", task_id=f"t{k}", group_id="0:0", task={"q": f"What is {k} + 1?"},
                       iteration=0, attempt=2) for k in range(4)]
    results = rollouts_to_collector(gw, store, receiver.url, jobs, agent, score)
    assert [r.status for r in results] == ["succeeded"] * 4

    got = receiver.by_rollout()
    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    assert set(got) == {j.rollout_id for j in jobs}  # nothing outside a rollout, every rollout there
    for j in jobs:
        stored = {s.span_id for s in store.spans(j.rollout_id)}
        (root,) = [s for s in got[j.rollout_id] if not s["parent_id"]]  # the rollout's own span, never stored
        assert {s["span_id"] for s in got[j.rollout_id]} == stored | {root["span_id"]} and len(stored) == 2
        (record,) = [s for s in got[j.rollout_id] if "lightning.llm.policy" in s["attributes"]]
        (reward,) = [s for s in got[j.rollout_id] if s["name"] == REWARD_SPAN]
        a = record["attributes"]
        # gen_ai semantic conventions: span "chat <model>", gen_ai.* attributes; the call is there once
        assert record["name"] == f"chat {SERVED}" and a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.request.model"] == SERVED and a["gen_ai.usage.output_tokens"] == len(a[COMPLETION_IDS])
        assert a["lightning.rollout.attempt"] == 2 and a["lightning.component"] == "solver"
        assert record["trace_id"] == j.trace_id == reward["trace_id"] == root["trace_id"]  # one trace per rollout
        assert record["parent_id"] == reward["parent_id"] == root["span_id"]
        assert root["attributes"]["lightning.reward.value"] == 1.0 and root["attributes"]["lightning.task.id"] == j.task_id
        (kept,) = [s for s in store.spans(j.rollout_id) if s.span_id == record["span_id"]]
        assert a[COMPLETION_IDS] == kept.attributes[COMPLETION_IDS] and len(a[COMPLETION_IDS]) >= 1
        assert kept.source == "gateway" and reward["attributes"][REWARD_VALUE] == 0.25
    store.close()


# A short real run in its own process: the application sets its own global provider first (the global provider
# can be set once per process), then Runtime(cfg).run().
APP = """
import json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
app_exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(app_exporter))
trace.set_tracer_provider(provider)

from rich.console import Console
from lightning_sdk import config
from lightning_sdk.runtime import Runtime
runtime = Runtime(config.load(sys.argv[1]), console=Console(file=sys.stderr))
state = runtime.run()
spans = [{"name": s.name, "rollout": s.attributes.get("lightning.rollout.id"), "span_id": format(s.context.span_id, "016x")}
         for s in app_exporter.get_finished_spans()]
print(json.dumps({"app_spans": spans, "baseline": state.baseline_eval, "final": runtime.final_eval,
                  "history_keys": sorted({k for row in state.history for k in row})}))
"""


def test_a_real_run_reaches_the_app_provider_the_collector_and_every_tracker(tmp_path, receiver):
    d = tmp_path
    shutil.copy(ROOT / "cookbook/arith/agent.py", d / "agent.py")
    rows = (ROOT / "cookbook/arith/data/train.jsonl").read_text().splitlines()
    (d / "train.jsonl").write_text("\n".join(rows[:4]) + "\n")
    (d / "eval.jsonl").write_text("\n".join(rows[-2:]) + "\n")
    (d / "lightning.toml").write_text(f"""
[run]
name = "obs"
dir = "run"
iterations = 1
report_to = ["tensorboard", "mlflow", "wandb"]
otlp_endpoint = "{receiver.url}"
[agent]
module = "agent.py"
[data]
train = "train.jsonl"
eval = "eval.jsonl"
tasks_per_iteration = 2
group_size = 2
[model]
dtype = "float32"
[rollout]
concurrency = 4
""")
    (d / "app.py").write_text(APP)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    p = subprocess.run([sys.executable, str(d / "app.py"), str(d / "lightning.toml")], cwd=d, env=env, text=True,
                       capture_output=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    run = d / "run"

    store = Store(run / "store.sqlite")
    rollouts = store.rollouts()
    assert len(rollouts) == 4 + 2 + 2  # train, eval before, eval after
    stored = {r.rollout_id: {s.span_id for s in store.spans(r.rollout_id)} for r in rollouts}
    assert all(stored.values())
    # The OTLP collector received every span the run stored and each rollout's own span, the root of its trace
    # (the exporter's last batch is sent when the process exits)...
    roots = {k: {s["span_id"] for s in v if not s["parent_id"]} for k, v in receiver.by_rollout().items()}
    assert set(roots) == set(stored) and all(len(r) == 1 for r in roots.values())
    exported = {k: ids | roots[k] for k, ids in stored.items()}
    assert {k: {s["span_id"] for s in v} for k, v in receiver.by_rollout().items()} == exported
    # ...and so did the application's own provider (before this, it received none).
    app: dict[str, set[str]] = {}
    for s in out["app_spans"]:
        app.setdefault(s["rollout"], set()).add(s["span_id"])
    assert app == exported

    # The eval scores, before and after, in every sink.
    baseline, final = out["baseline"], out["final"]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["eval"], r["iteration"], r["eval/reward_mean"]) for r in lines if r.get("phase") == "eval"]
    assert evals == [("untrained", 0, baseline), ("trained", 1, final)]
    assert [r["iteration"] for r in lines if r.get("phase") != "eval"] == [1]  # iterations count from 1

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # One name everywhere: metrics.jsonl, every tracker, result.history and the dashboard's API name each number
    # the same (metric_names: `train/loss`, `rollout/reward_mean`, `eval/reward_mean`); TensorBoard groups the tags
    # by what comes before the "/", so none stands alone at the top level
    logged = {k for r in lines for k, v in r.items()
              if k not in names.LABELS and isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert {names.REWARD_MEAN, names.train("loss"), names.timing("collect_s"), names.EVAL_REWARD_MEAN} <= logged
    assert all(names.current(k) == k for k in logged)  # today's names only
    tb = EventAccumulator(str(run / "tensorboard"))
    tb.Reload()
    assert set(tb.Tags()["scalars"]) == logged
    assert {t.split("/")[0] for t in logged} == {"eval", "rollout", "train", "time"}
    assert [(e.step, e.value) for e in tb.Scalars("eval/reward_mean")] == [(0, pytest.approx(baseline)),
                                                                          (1, pytest.approx(final))]
    assert [e.step for e in tb.Scalars("rollout/reward_mean")] == [1]
    assert [e.step for e in tb.Scalars("train/loss")] == [1]
    summary = RunReader(d).summary("run")
    assert {k for h in summary["history"] for k in h} - {"checkpoint"} == set(lines[1]) == set(out["history_keys"])
    # the settings as TensorBoard's hparams (a run of their own beside the scalars), one per dotted key
    (hp_dir,) = [d for d in (run / "tensorboard").iterdir() if d.is_dir() and any(d.glob("events.out.*"))]
    hp = EventAccumulator(str(hp_dir))
    hp.Reload()
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = hp.PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = {k: v.number_value or v.string_value for k, v in session.session_start_info.hparams.items()}
    assert hparams["train.lr"] == pytest.approx(2e-3) and hparams["run.name"] == "obs"

    import mlflow

    # MLflow's default: a SQLite store in the run directory (not the file store MLflow refuses), its INFO lines
    # kept out of the run's output
    assert (run / "mlflow.db").exists() and not (run / "mlruns").exists()
    assert "INFO mlflow" not in p.stdout + p.stderr
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("obs").experiment_id])
    assert set(mlrun.data.metrics) == logged
    history = client.get_metric_history(mlrun.info.run_id, "eval/reward_mean")
    assert sorted((m.step, m.value) for m in history) == [(0, pytest.approx(baseline)), (1, pytest.approx(final))]
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "train/loss")] == [1]
    # params flattened: filterable by each setting
    assert mlrun.data.params["train.lr"] == "0.002" and mlrun.data.params["data.group_size"] == "2"
    assert not any(v.startswith("{") and v != "{}" for v in mlrun.data.params.values())  # no table as text
    assert client.search_runs([mlrun.info.experiment_id], "params.`train.lr` = '0.002'")

    (offline,) = (run / "wandb").glob("offline-run-*/*.wandb")
    history = wandb_history(offline)
    assert [(step, row["eval/reward_mean"]) for step, row in history if "eval/reward_mean" in row] == \
        [(0, pytest.approx(baseline)), (1, pytest.approx(final))]
    assert [step for step, row in history if "train/loss" in row] == [1]
    assert {k for _, row in history for k in row if not k.startswith("_")} == logged
    assert wandb_config(offline)["train.lr"] == 2e-3  # the settings, one per dotted key


def wandb_records(path: Path):
    """The records of an offline W&B run file (what `wandb sync` uploads), read back: LevelDB-log framing (32 KiB
    blocks; records of crc32, length, type), each record a wandb `Record` protobuf. The wandb package ships no
    reader for it."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, pos, parts = path.read_bytes(), 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_history(path: Path) -> list[tuple[int, dict]]:
    return [(int(r.history.step.num), {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                       for item in r.history.item})
            for r in wandb_records(path) if r.WhichOneof("record_type") == "history"]


def wandb_config(path: Path) -> dict:
    return {item.key: json.loads(item.value_json) for r in wandb_records(path)
            if r.WhichOneof("record_type") in ("config", "run") for item in
            (r.config.update if r.WhichOneof("record_type") == "config" else r.run.config.update)}
