"""Placement (lightning_sdk/placement.py) as a function of the visible GPUs and the config: no GPU needed."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from lightning_sdk import config
from lightning_sdk.errors import SetupError
from lightning_sdk.placement import defaults_for, gpu_environment, place, settle
from lightning_sdk.runtime.preflight import check_placement, preflight


def cfg(**tables):
    """A config; serve.backend 'auto' unless given (resolved by the `backend` each test passes to place)."""
    tables["serve"] = {"backend": "auto", **tables.get("serve", {})}
    return config.parse({"agent": {"module": "agent"}, "data": {"train": "t.jsonl"}, **tables})


@pytest.mark.parametrize("visible, tables, replicas, train", [
    (0, {}, ((),), ()),                                                       # the CPU, as ever
    (0, {"serve": {"replicas": 2}}, ((), ()), ()),                            # two built-in servers on the CPU
    (1, {}, ((0,),), (0,)),                                                   # one GPU: shared in turns
    (2, {}, ((0,),), (1,)),
    (3, {}, ((0,), (1,)), (2,)),
    (8, {}, ((0,), (1,), (2,), (3,)), (4, 5, 6, 7)),
    (8, {"serve": {"tensor_parallel_size": 2}}, ((0, 1), (2, 3)), (4, 5, 6, 7)),
    (8, {"serve": {"replicas": 1}}, ((0,),), (1, 2, 3, 4, 5, 6, 7)),
    (4, {"devices": {"train": [3]}}, ((0,), (1,), (2,)), (3,)),
    (4, {"devices": {"serve": [2, 3]}}, ((2,), (3,)), (0, 1)),
    (2, {"devices": {"serve": [0, 1], "train": [0, 1]}}, ((0,), (1,)), (0, 1)),  # both shared, in turns
    (4, {"train": {"device": "cpu"}}, ((0,), (1,), (2,), (3,)), ()),          # the trainer on the CPU: all serve
])
def test_the_split_of_the_visible_gpus(visible, tables, replicas, train):
    p = place(cfg(**tables), visible=visible, backend="vllm" if visible else "cpu")
    assert (p.replicas, p.train) == (replicas, train)


def test_the_built_in_server_on_a_gpu_is_placed_like_vllm():
    p = place(cfg(serve={"device": "cuda:1"}), visible=2, backend="cpu")
    assert (p.replicas, p.train, p.apart) == (((1,),), (0,), True)
    assert place(cfg(), visible=2, backend="cpu").replicas == ((),)  # serve.device = 'cpu': the CPU
    builtin = cfg(serve={"device": "cuda:1"})  # apart, pipelined; vLLM's keys are not its to imply
    assert settle(builtin, p).endswith("at once (pipelined); so train.max_staleness = 1")
    assert (builtin.serve.sleep_level, builtin.serve.gpu_memory_utilization) == (1, 0.5)


def test_with_ray_the_servers_are_rays_to_place_and_the_trainer_keeps_the_head():
    p = place(cfg(run={"runtime": "ray"}, serve={"backend": "vllm"}), visible=4, backend="vllm")
    assert (p.replicas, p.train, p.apart) == ((), (0,), False)
    assert p.line() == ("placement: 4 GPU(s) visible; the inference servers where Ray places them, the trainer on "
                        "GPU 0; GPUs 1,2,3 left to Ray: with run.runtime = 'ray' the trainer takes train.processes = "
                        "1 GPU (set it to train on more)")
    four = cfg(run={"runtime": "ray"}, serve={"backend": "vllm"}, train={"processes": 4})
    assert place(four, visible=4, backend="vllm").training == (0, 1, 2, 3)
    with pytest.raises(SetupError, match=r"^train.processes = 4 takes one GPU each; only 2 GPU\(s\) are visible"):
        place(four, visible=2, backend="vllm")


def test_apart_pipelines_unless_the_config_says_otherwise_and_one_gpu_stays_as_it_was():
    one = cfg(serve={"backend": "vllm"})
    assert defaults_for(one, place(one, visible=1, backend="vllm")) == []
    assert (one.train.max_staleness, one.serve.sleep_level, one.serve.gpu_memory_utilization) == (0, 1, 0.5)
    two = cfg(serve={"backend": "vllm"})
    p = place(two, visible=2, backend="vllm")
    assert defaults_for(two, p) == ["serve.sleep_level = 0", "serve.gpu_memory_utilization = 0.9",
                                    "train.max_staleness = 1"]
    assert (two.train.max_staleness, two.serve.sleep_level) == (1, 0)
    assert "max_staleness" not in two.train.model_fields_set  # still a default: the next model's would follow
    assert p.line() == ("placement: 2 GPU(s) visible; 1 inference server on GPU 0, the trainer on GPU 1, at once "
                        "(pipelined)")
    kept = cfg(serve={"backend": "vllm"}, train={"max_staleness": 0})
    assert defaults_for(kept, place(kept, visible=2, backend="vllm")) == ["serve.sleep_level = 0",
                                                                         "serve.gpu_memory_utilization = 0.9"]
    assert kept.train.max_staleness == 0


@pytest.mark.parametrize("visible, tables, backend, words", [
    (2, {"devices": {"train": [2]}}, "vllm", "devices.train = [2]: only 2 GPU(s) are visible (0-1)"),
    (0, {"serve": {"device": "cuda"}, "devices": {"serve": [0]}}, "cpu", "devices.serve = [0]: no CUDA GPU"),
    (4, {"serve": {"tensor_parallel_size": 2, "backend": "auto"}}, "cpu", "serve.tensor_parallel_size = 2: "),
    (2, {"serve": {"replicas": 3}}, "vllm", "serve.replicas = 3 x serve.tensor_parallel_size = 1: needs 3 GPUs"),
])
def test_gpus_that_are_not_there_are_one_line_naming_the_key(visible, tables, backend, words):
    with pytest.raises(SetupError) as e:
        place(cfg(**tables), visible=visible, backend=backend)
    assert str(e.value).startswith(words), str(e.value)


def test_each_process_gets_its_gpus_through_cuda_visible_devices():
    assert gpu_environment((0, 1), {}) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert gpu_environment((1, 2), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == {"CUDA_VISIBLE_DEVICES": "5,6"}
    assert gpu_environment((), {"CUDA_VISIBLE_DEVICES": "4"}) == {}  # a CPU process inherits


@pytest.mark.parametrize("tables, words", [
    ({"devices": {"serve": [0, 0]}}, "devices.serve: expected a non-empty list of distinct GPU indices"),
    ({"devices": {"srve": [0]}}, "devices.srve: unknown key; did you mean devices.serve?"),
    ({"serve": {"tensor_parallel_size": 2, "backend": "cpu"}}, "serve.tensor_parallel_size = 2: tensor parallelism"),
    ({"serve": {"replicas": 2, "backend": "vllm"}, "devices": {"serve": [0]}},
     "devices.serve = [0]: expected serve.replicas x serve.tensor_parallel_size = 2 x 1 GPUs"),
    ({"run": {"runtime": "ray"}, "serve": {"replicas": 2}}, "serve.replicas: with run.runtime = 'ray'"),
    ({"serve": {"extra_args": ["--tensor-parallel-size", "2"]}}, "serve.extra_args: ['--tensor-parallel-size']"),
])
def test_the_placement_keys_are_checked_at_the_edge(tables, words):
    with pytest.raises(config.ConfigError) as e:
        cfg(**tables)
    assert str(e.value).startswith(words), str(e.value)


def test_a_vllm_replica_spans_its_gpu_set_with_tensor_parallelism(tmp_path):
    from lightning_sdk.servers.select import vllm_server

    two = cfg(serve={"backend": "vllm", "tensor_parallel_size": 2})
    cmd = vllm_server(two, "/models/qwen", tmp_path / "s.log").command()
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in vllm_server(cfg(serve={"backend": "vllm"}), "/models/qwen",
                                                       tmp_path / "s.log").command()


def test_data_parallel_trainer_processes_take_one_gpu_each():
    assert place(cfg(train={"processes": 2}), visible=4, backend="vllm").train == (2, 3)
    with pytest.raises(SetupError, match=r"train.processes = 2 takes one GPU each; the trainer has 1 \(\[1\]\)"):
        place(cfg(train={"processes": 2}), visible=2, backend="vllm")
    assert place(cfg(train={"processes": 2}), visible=0, backend="cpu").train == ()  # CPU ranks: no GPU to count


# Every TOML example of the GPU docs, read out of the docs themselves so the docs cannot drift from the code.
ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/gpu.md", "docs/scaling.md")
BLOCKS = [(f"{doc}#{i}", block) for doc in DOCS
          for i, block in enumerate(re.findall(r"^```toml\n(.*?)^```", (ROOT / doc).read_text(), re.S | re.M))]
CONFIGS = [("lightning.toml", (ROOT / "lightning.toml").read_text())] + BLOCKS


def toml_config(text: str) -> config.Config:
    """`text` as a run's config; a block that names no agent or data gets placeholders (nothing is loaded)."""
    tables = tomllib.loads(text)
    tables.setdefault("agent", {}).setdefault("module", "agent.py")
    tables.setdefault("data", {}).setdefault("train", "train.jsonl")
    return config.parse(tables)


def idle_gpus(words: str) -> set[int]:
    """The GPUs a placement's line names idle (or, with Ray, left to Ray's servers)."""
    return {int(g) for ids in re.findall(r"GPUs? ([\d,]+) (?:idle|left to Ray)", words) for g in ids.split(",")}


def test_the_docs_have_the_blocks_this_test_places():
    assert len([b for b in BLOCKS if b[0].startswith("docs/gpu.md")]) >= 1
    assert len([b for b in BLOCKS if b[0].startswith("docs/scaling.md")]) >= 5


@pytest.mark.parametrize("visible", [1, 2, 4, 8])
@pytest.mark.parametrize("name, text", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_every_gpu_works_or_its_line_says_why_and_the_preflight_passes(name, text, visible):
    cfg = toml_config(text)
    backend = "vllm" if cfg.serve.backend == "vllm" or (cfg.serve.backend == "auto" and visible) else "cpu"
    try:
        p = place(cfg, visible=visible, backend=backend)
    except SetupError as e:  # only an example written for more GPUs, refused with one line naming its own key
        assert name.startswith("docs/scaling.md") and visible < 8, f"{name} on {visible} GPUs: {e}"
        key = str(e).split(" ")[0]
        assert key.startswith(("devices.", "train.processes", "serve.tensor_parallel_size")), str(e)
        assert re.search(rf"^\s*{key.split('.')[-1]}\s*=", text, re.M), f"{key} is not set in {name}: {e}"
        return
    line = settle(cfg, p)
    check_placement(cfg, p, backend)  # the pre-flight's placement faults: none
    working = set(p.serving) | set(p.training)
    assert p.processes == cfg.train.processes  # what start_trainer starts: one process per GPU of p.training
    assert not working & idle_gpus(line or ""), line
    assert working | idle_gpus(line or "") == set(range(visible)), line


def test_the_issues_cases_use_every_gpu():
    four = {"serve": {"backend": "vllm"}}
    for tables, serving, training in [
        (four, (0, 1), (2, 3)),
        ({"serve": {"backend": "vllm", "replicas": 1}}, (0,), (1, 2, 3)),
        ({"serve": {"backend": "vllm", "tensor_parallel_size": 2}}, (0, 1), (2, 3)),
    ]:
        c = cfg(**tables)
        p = place(c, visible=4, backend="vllm")
        line = settle(c, p)
        assert (p.serving, p.training, p.processes, p.idle) == (serving, training, len(training), ""), line
        assert c.train.processes == len(training) and "processes" not in c.train.model_fields_set  # a default
        assert f"train.processes = {len(training)}" in line, line


def test_scaling_md_prints_the_line_the_code_prints():
    c = cfg(model={"name": "/models/Qwen2.5-1.5B-Instruct"}, serve={"backend": "vllm"})
    said = settle(c, place(c, visible=4, backend="vllm"))
    shown = re.findall(r"^    (placement: .*)$", (ROOT / "docs/scaling.md").read_text(), re.M)
    assert shown == [said]


@pytest.mark.parametrize("tables, visible, words", [
    ({"train": {"processes": 1}}, 4, "GPU 3 idle: train.processes = 1 is set, one trainer process on one GPU"),
    ({"devices": {"serve": [0], "train": [1]}}, 4, "GPUs 2,3 idle: neither devices.serve nor devices.train names them"),
    ({"devices": {"train": [3]}, "serve": {"tensor_parallel_size": 2}}, 4,
     "GPU 2 idle: each replica takes serve.tensor_parallel_size = 2 GPUs"),
    ({"devices": {"train": [3]}, "serve": {"replicas": 1}}, 4,
     "GPUs 1,2 idle: serve.replicas = 1 x serve.tensor_parallel_size = 1 serve on 1 GPU"),
    ({"train": {"device": "cpu"}, "serve": {"tensor_parallel_size": 2}}, 5,
     "GPU 4 idle: each replica takes serve.tensor_parallel_size = 2 GPUs; the trainer is on the CPU"),
    ({"serve": {"backend": "cpu"}, "train": {"device": "cpu"}}, 2,
     "GPUs 0,1 idle: the built-in server and the trainer are on the CPU"),
    ({"serve": {"backend": "cpu"}, "train": {"device": "cuda:1"}}, 4,
     "GPUs 0,2,3 idle: the built-in server is on the CPU (serve.device = 'cpu') and the trainer has only "
     "train.device = 'cuda:1'"),
])
def test_a_gpu_a_setting_leaves_idle_is_named_with_the_setting(tables, visible, words):
    tables["serve"] = {"backend": "vllm", **tables.get("serve", {})}
    c = cfg(**tables)
    p = place(c, visible=visible, backend=c.serve.backend)
    line = settle(c, p)
    assert p.idle.startswith(words) and line.endswith(f"; {p.idle}"), line  # the line's last words
    assert idle_gpus(line) == set(range(visible)) - set(p.serving) - set(p.training)


def test_sleep_level_1_set_apart_is_kept_and_collection_and_update_take_turns():
    c = cfg(serve={"backend": "vllm", "sleep_level": 1, "gpu_memory_utilization": 0.45})
    p = place(c, visible=2, backend="vllm")
    line = settle(c, p)
    assert (c.serve.sleep_level, c.serve.gpu_memory_utilization, c.train.max_staleness) == (1, 0.45, 0)
    assert "in turns (serve.sleep_level = 1 is set" in line and "max_staleness = 1;" not in line, line
    check_placement(c, p, "vllm")  # passes: nothing the user did not set is implied against it
    loose = cfg(serve={"backend": "vllm"}, train={"max_staleness": 0})
    assert "in turns (train.max_staleness = 0 is set)" in settle(loose, place(loose, visible=2, backend="vllm"))


@pytest.mark.parametrize("tables, visible, words, never", [
    ({"serve": {"sleep_level": 1}, "train": {"max_staleness": 1}}, 2,
     "train.max_staleness = 1 (set) has vLLM serve the next batch during each update, so it never sleeps, but "
     "serve.sleep_level = 1 (set) asks it to sleep during each update; on GPUs of its own it need not", "memory"),
    ({"train": {"max_staleness": 1}}, 1,
     "train.max_staleness = 1 (set) has vLLM serve the next batch during each update, so vLLM and the trainer must "
     "fit in memory at once on the GPU they share, but serve.sleep_level = 1 (the default) puts vLLM to sleep",
     "GPUs of its own"),
])
def test_the_preflight_names_the_keys_as_set_or_default_and_the_real_reason(tables, visible, words, never):
    tables["serve"] = {"backend": "vllm", **tables.get("serve", {})}
    c = cfg(**tables)
    p = place(c, visible=visible, backend="vllm")
    settle(c, p)
    with pytest.raises(SetupError) as e:
        check_placement(c, p, "vllm")
    assert str(e.value).startswith(words) and never not in str(e.value), str(e.value)
    with pytest.raises(SetupError, match="train.max_staleness = 1 .set."):
        preflight(c, ROOT / "runs" / "never-made", p)
    assert not (ROOT / "runs" / "never-made").exists()


def test_python_m_placement_prints_the_lines_a_run_would_print(tmp_path):
    import os
    import subprocess
    import sys

    toml = tmp_path / "vllm.toml"
    toml.write_text((ROOT / "lightning.toml").read_text().replace('backend = "cpu"', 'backend = "vllm"'))
    out = subprocess.run([sys.executable, "-m", "lightning_sdk.placement", str(toml), "1", "4"], capture_output=True,
                         text=True, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    c = config.load(toml)
    assert out.stdout.splitlines() == ["1 GPU(s): placement: 1 GPU(s) visible; 1 inference server on GPU 0, the "
                                       "trainer on GPU 0, in turns (the server sleeps during each update)",
                                       f"4 GPU(s): {settle(c, place(c, visible=4, backend='vllm'))}"]


@pytest.mark.parametrize("args, said", [
    (["missing.toml"], "python -m lightning_sdk.placement: CONFIG: missing.toml: cannot read (No such file or "
                       "directory)"),
    (["lightning.toml", "4", "four"], "python -m lightning_sdk.placement: N = 'four': expected a number of GPUs "
                                      "(0, 1, 2, ...)"),
    (["lightning.toml", "-1"], "python -m lightning_sdk.placement: N = '-1': expected a number of GPUs (0, 1, 2, ...)"),
])
def test_python_m_placement_refuses_bad_input_in_one_line(args, said):
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lightning_sdk.placement", *args], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (out.returncode, out.stdout, out.stderr) == (2, "", said + "\n")


def test_a_train_processes_the_counted_gpus_cannot_hold_is_refused_before_the_run_dir_is_made(tmp_path, monkeypatch):
    # The built-in server on the CPU: visible_gpus skips the count (torch) until after the run's first line, except
    # where the count can refuse the config. One GPU stands in for the machine's (torch's own count, set).
    import io

    import torch
    from rich.console import Console

    from lightning_sdk.runtime import Runtime
    from tests.test_runtime_faults import make_project, task

    c = make_project(tmp_path, [task(1, 2)], serve='backend = "cpu"', train="lora_r = 4\nprocesses = 2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SetupError, match=r"^train.processes = 2 takes one GPU each; the trainer has 1 \(\[0\]\)"):
        Runtime(c, console=Console(file=io.StringIO())).run()
    assert not (tmp_path / "run").exists()
