"""Placement (lightning_sdk/placement.py) as a function of the visible GPUs and the config: no GPU needed."""

from __future__ import annotations

import pytest

from lightning_sdk import config
from lightning_sdk.errors import SetupError
from lightning_sdk.placement import defaults_for, gpu_environment, place


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


def test_with_ray_the_servers_are_rays_to_place_and_the_trainer_keeps_the_head():
    p = place(cfg(run={"runtime": "ray"}, serve={"backend": "vllm"}), visible=4, backend="vllm")
    assert (p.replicas, p.train, p.apart) == ((), (0, 1, 2, 3), False)
    assert p.line() == ("placement: 4 GPU(s) visible; the inference servers where Ray places them, the trainer on "
                        "GPUs 0,1,2,3")


def test_apart_pipelines_unless_the_config_says_otherwise_and_one_gpu_stays_as_it_was():
    one = cfg(serve={"backend": "vllm"})
    assert defaults_for(one, place(one, visible=1, backend="vllm")) == []
    assert (one.train.max_staleness, one.serve.sleep_level, one.serve.gpu_memory_utilization) == (0, 1, 0.5)
    two = cfg(serve={"backend": "vllm"})
    p = place(two, visible=2, backend="vllm")
    assert defaults_for(two, p) == ["train.max_staleness = 1", "serve.sleep_level = 0",
                                    "serve.gpu_memory_utilization = 0.9"]
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
