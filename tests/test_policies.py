"""One policy per component: config rules, then real steps of two named adapters on one base model (no mocks)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightning_sdk import config, models
from lightning_sdk.config import TrainConfig
from lightning_sdk.files import load_py_file
from lightning_sdk.train.trainer import GRPOTrainer, checkpoint_conflict
from lightning_sdk.transitions import Transition

torch.set_num_threads(1)  # the CI machine is small and shared
arith = load_py_file(Path(__file__).parents[1] / "cookbook" / "arith" / "teacher.py")

BASE = """
[agent]
module = "agent.py"
[data]
train = "train.jsonl"
"""


def load(tmp_path, extra: str) -> config.Config:
    p = tmp_path / "lightning.toml"
    p.write_text(BASE + extra)
    return config.load(p)


# --------------------------------------------------------------------------------------------------- config


def test_policies_take_train_and_their_own_keys(tmp_path):
    cfg = load(tmp_path, '[train]\nlr = 1e-3\nbeta = 0.1\n[policies.writer]\ncomponents = ["writer"]\nlora_r = 4\n'
                         '[policies.fixer]\ncomponents = ["rewriter", "fixer"]\nlr = 5e-4\n')
    ps = config.policies(cfg)
    assert [(p.name, p.components) for p in ps] == [("writer", ("writer",)), ("fixer", ("rewriter", "fixer"))]
    assert (ps[0].train.lr, ps[0].train.lora_r, ps[1].train.lr, ps[1].train.lora_r) == (1e-3, 4, 5e-4, 8)  # builtin: defaults
    assert ps[0].train.beta == ps[1].train.beta == 0.1
    # without [policies]: one policy named after the run, training rollout.components
    one = config.policies(load(tmp_path, '[run]\nname = "r"\n[rollout]\ncomponents = ["a"]\n'))
    assert [(p.name, p.components) for p in one] == [("r", ("a",))]
    assert config.override(cfg, {"train.lr": 2e-3}).policies["fixer"].lr == 5e-4  # overrides keep the tables


@pytest.mark.parametrize("extra, line", [
    ('[policies.w]\ncomponents = ["a"]\n[policies.v]\ncomponents = ["b", "a"]\n',
     "policies.v.components: 'a' is already in policies.w"),
    ('[policies.w]\ncomponents = []\n', "policies.w.components: an empty policy"),
    ('[policies.w]\ncomponents = ["a"]\nbeta = 0.1\n', "policies.w: beta cannot vary per policy"),
    ('[policies.w]\ncomponents = ["a"]\nlearning_rate = 0.1\n', "policies.w.learning_rate: unknown key"),
    ('[rollout]\ncomponents = ["a"]\n[policies.w]\ncomponents = ["a"]\n',
     "rollout.components and [policies] both choose the components to train: keep one of them"),
    ('[policies.default]\ncomponents = ["a"]\n', "policies.default: expected"),
    ('[train]\nprocesses = 2\nshard = "fsdp"\n[policies.w]\ncomponents = ["a"]\n',
     "[policies] (w) with train.shard = 'fsdp': a sharded base trains one adapter"),
])
def test_bad_policies_are_one_line(tmp_path, extra, line):
    with pytest.raises(config.ConfigError) as e:
        load(tmp_path, extra)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_bad_policy_exits_2_with_the_line(tmp_path):
    from click.testing import CliRunner

    from lightning_sdk.cli import main

    (tmp_path / "lightning.toml").write_text(BASE + '[policies.w]\ncomponents = []\n')
    out = CliRunner().invoke(main, ["run", "--config", str(tmp_path / "lightning.toml")])
    assert out.exit_code == 2 and "policies.w.components: an empty policy" in out.output


def test_vllm_holds_two_adapters_per_policy_at_every_policys_rank(tmp_path):
    from lightning_sdk.servers.select import vllm_server

    policies = "".join(f'[policies.p{i}]\ncomponents = ["c{i}"]\n' for i in range(3))
    cfg = load(tmp_path, '[serve]\nbackend = "vllm"\n[train]\nlora_r = 8\n' + policies + "lora_r = 20\n")
    cmd = vllm_server(cfg, "/models/qwen", tmp_path / "server.log").command()
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--max-loras"] == "6" and flags["--max-lora-rank"] == "32"  # 2 x 3 policies; p2's r 20 -> 32
    one = load(tmp_path, '[serve]\nbackend = "vllm"\nmax_loras = 3\n')
    assert dict(zip(c := vllm_server(one, "m", tmp_path / "s.log").command(), c[1:]))["--max-loras"] == "3"


# ------------------------------------------------------------------------------------------ real model steps


@pytest.fixture(scope="module")
def model_path() -> str:
    return models.resolve("builtin:tiny-arith")


@pytest.fixture(scope="module")
def tok(model_path):
    return models.load_tokenizer(model_path)


def batch(tok, components=("writer", "rewriter")) -> list[Transition]:
    """Two groups of two rollouts; each rollout makes a writer call, and some a rewriter call."""
    def t(rid, gid, idx, comp, a, b, text, reward):
        msgs = [{"role": "user", "content": arith.question(a, b)}]
        prompt = tuple(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
        return Transition(rid, gid, f"{rid}.{idx}", idx, comp, prompt, tuple(tok(text)["input_ids"]) +
                          (tok.eos_token_id,), None, reward)
    out = [t("r1", "g1", 0, "writer", 3, 4, "7", 1.0), t("r1", "g1", 1, "rewriter", 3, 4, "7", 1.0),
           t("r2", "g1", 0, "writer", 3, 4, "8", 0.0),
           t("r3", "g2", 0, "writer", 2, 9, "11", 1.0), t("r4", "g2", 0, "writer", 2, 9, "12", 0.0),
           t("r4", "g2", 1, "rewriter", 2, 9, "13", 0.0)]
    return [x for x in out if x.component in components]


def two_policies(**kw) -> list[config.Policy]:
    train = TrainConfig(device="cpu", lr=1e-2, target_modules=["all-linear", "lm_head"], **kw)
    return [config.Policy("writer", ("writer",), train),
            config.Policy("rewriter", ("rewriter",), train.model_copy(update={"lora_r": 4, "lr": 5e-3}))]


def params_of(tr: GRPOTrainer, name: str | None) -> dict[str, torch.Tensor]:
    """The adapter's LoRA tensors (name None: everything that is not LoRA, the base)."""
    return {n: p.detach().clone() for n, p in tr.model.named_parameters()
            if (f".{name}." in n and "lora_" in n if name else "lora_" not in n)}


def test_each_policy_trains_its_own_adapter_on_its_own_calls(model_path, tok, tmp_path):
    ps = two_policies()
    tr = GRPOTrainer(model_path, ps[0].train, policies=ps, seed=0)
    assert set(tr.model.peft_config) == {"writer", "rewriter"}  # peft's named adapters on one model, no copy
    assert tr.model.peft_config["rewriter"].r == 4
    # each policy targets what its config says, as a single policy would ("all-linear" + lm_head expanded)
    assert tr.model.peft_config["rewriter"].target_modules == tr.model.peft_config["writer"].target_modules
    assert "lm_head" in tr.model.peft_config["rewriter"].target_modules
    base, writer, rewriter = params_of(tr, None), params_of(tr, "writer"), params_of(tr, "rewriter")

    # A batch of writer calls only: the writer's adapter moves, the rewriter's and the base stay.
    m = tr.step(batch(tok, ("writer",)))
    assert all(not torch.equal(writer[n], p) for n, p in params_of(tr, "writer").items() if "lora_B" in n)
    assert all(torch.equal(rewriter[n], p) for n, p in params_of(tr, "rewriter").items())
    assert m["writer.num_transitions"] == 4 and m["rewriter.num_transitions"] == 0
    assert math.isnan(m["rewriter.episode_reward_mean"]) and m["writer.loss"] == m["writer.loss"]
    assert "loss" not in m and m["step"] == 1.0

    # Both roles: the rewriter's calls take their rollouts' advantages over the whole group (r1 won, r4 lost).
    writer = params_of(tr, "writer")
    m = tr.step(batch(tok))
    assert m["rewriter.num_transitions"] == 2 and m["rewriter.adv_mean"] == pytest.approx(0.0, abs=1e-6)
    # +-1/sqrt(2): each rollout's outcome against its whole group (1 vs 0), though each group has one rewriter call
    assert m["rewriter.adv_std"] == pytest.approx(1.0, rel=1e-3)
    assert all(not torch.equal(rewriter[n], p) for n, p in params_of(tr, "rewriter").items() if "lora_B" in n)
    assert all(not torch.equal(writer[n], p) for n, p in params_of(tr, "writer").items() if "lora_B" in n)
    assert all(torch.equal(base[n], p) for n, p in params_of(tr, None).items())  # the base stayed frozen
    assert tr.adapters["rewriter"].optimizer.param_groups[0]["lr"] == 5e-3

    # Checkpoint: one adapter per policy, each the same as serving it alone on the base model.
    from peft import PeftModel

    tr.save_state(tmp_path / "trainer")
    assert sorted(p.name for p in (tmp_path / "trainer/adapters").iterdir() if p.is_dir()) == ["rewriter", "writer"]
    state = json.loads((tmp_path / "trainer/trainer_state.json").read_text())
    assert state["policies"]["rewriter"]["lora_r"] == 4
    ids = torch.tensor([batch(tok)[1].prompt_ids])
    for name in ("writer", "rewriter"):
        alone = PeftModel.from_pretrained(models.load_causal_lm(model_path),
                                          str(tmp_path / "trainer/adapters" / name)).eval()
        tr.model.set_adapter(name)
        with torch.no_grad():
            torch.testing.assert_close(alone(input_ids=ids).logits, tr.model.eval()(input_ids=ids).logits)


def test_resume_restores_both_optimizers(model_path, tok, tmp_path):
    ps = two_policies()
    a = GRPOTrainer(model_path, ps[0].train, policies=ps, seed=0)
    a.step(batch(tok))
    a.save_state(tmp_path / "ckpt")
    assert checkpoint_conflict(tmp_path / "ckpt", ps[0].train, ps) is None
    b = GRPOTrainer(model_path, ps[0].train, policies=ps, seed=7)  # another init, all overwritten
    b.load_state(tmp_path / "ckpt")
    for name in ("writer", "rewriter"):
        sa, sb = a.adapters[name].optimizer.state_dict(), b.adapters[name].optimizer.state_dict()
        assert sa["state"] and sa["state"].keys() == sb["state"].keys()
        for k in sa["state"]:
            assert all(torch.equal(sa["state"][k][s], sb["state"][k][s]) for s in ("exp_avg", "exp_avg_sq"))
    ma, mb = a.step(batch(tok)[::-1]), b.step(batch(tok)[::-1])
    assert (ma["writer.loss"], ma["rewriter.grad_norm"]) == (mb["writer.loss"], mb["rewriter.grad_norm"])
    for n, p in a.model.named_parameters():
        assert torch.equal(p, b.model.get_parameter(n)), n

    # Another set of policies, or another rank, cannot continue this checkpoint: one line naming the key.
    assert "policies.rewriter.lora_r = 16, but the checkpoint" in checkpoint_conflict(
        tmp_path / "ckpt", ps[0].train, [ps[0], config.Policy("rewriter", ("rewriter",), ps[0].train)])
    assert "policies: the checkpoint" in checkpoint_conflict(tmp_path / "ckpt", ps[0].train, ps[:1])
    assert "policies: the checkpoint" in checkpoint_conflict(tmp_path / "ckpt", ps[0].train)


# ------------------------------------------------------------------------------------------------ a real run

AGENT = '''
from openai import AsyncOpenAI

import lightning_sdk as ls


@ls.rollout
async def solve(task: dict, llm: ls.LLM) -> list:
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key) as client:
        async def ask(role: str) -> str:
            with ls.component(role):
                out = await client.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": task["question"]}], temperature=1.0,
                    max_tokens=8)
            return out.choices[0].message.content or ""
        answers = [await ask("writer"), await ask("rewriter")]
        await ask("judge")  # a component in no policy: served by the base model, never trained
    return answers


@ls.reward
def score(task: dict, answers: list) -> float:
    return sum(a.strip() == task["answer"] for a in answers) / 2
'''


@pytest.fixture(scope="module")
def two_policy_run(tmp_path_factory):
    """`ls.run` of two policies (writer, rewriter) over an agent with a third, untrained component; 2 iterations,
    the second after a resume."""
    import lightning_sdk as ls

    d = tmp_path_factory.mktemp("policies")
    (d / "agent.py").write_text(AGENT)
    rows = (Path(__file__).parents[1] / "cookbook/arith/data/train.jsonl").read_text().splitlines()
    (d / "train.jsonl").write_text("\n".join(rows[::9]) + "\n")
    (d / "lightning.toml").write_text('''
[run]
name = "duo"
dir = "run"
iterations = 1
[agent]
module = "agent.py"
[data]
train = "train.jsonl"
tasks_per_iteration = 3
group_size = 4
[model]
name = "builtin:tiny-arith"
dtype = "float32"
[rollout]
concurrency = 8
[train]
micro_batch_size = 16
[policies.writer]
components = ["writer"]
[policies.rewriter]
components = ["rewriter"]
lora_r = 4
''')
    first = ls.run(d / "lightning.toml", run_dir=d / "run")
    second = ls.run(d / "lightning.toml", run_dir=d / "run", iterations=2, resume=True)
    return d, first, second


def test_two_policies_each_call_served_by_its_components_adapter(two_policy_run):
    from lightning_sdk import tracing
    from lightning_sdk.store import Store
    from lightning_sdk.tracing.records import COMPONENT, POLICY

    d, first, second = two_policy_run
    assert second.state.completed == 2 and second.state.adapter_names == {"writer": "duo-writer-iter2",
                                                                           "rewriter": "duo-rewriter-iter2"}
    store = Store(d / "run/store.sqlite")
    served: dict[tuple[int, str], set] = {}
    for r in store.rollouts(phase="train"):
        for s in store.spans(r.rollout_id):
            if tracing.is_llm_call(s) and s.source == "gateway":
                served.setdefault((r.iteration, s.attributes[COMPONENT]), set()).add(s.attributes[POLICY])
    base = "builtin:tiny-arith"
    assert served == {(1, "writer"): {base}, (1, "rewriter"): {base}, (1, "judge"): {base},
                      # iteration 2, after the resume: each component's call by its own policy's adapter
                      (2, "writer"): {"duo-writer-iter1"}, (2, "rewriter"): {"duo-rewriter-iter1"},
                      (2, "judge"): {base}}

    rows = second.history
    assert [r["policy"] for r in rows] == [f"writer={base}, rewriter={base}",
                                           "writer=duo-writer-iter1, rewriter=duo-rewriter-iter1"]
    for r in rows:  # 12 rollouts, one call of each role: each policy trains on its own 12, the judge's are counted
        assert r["rollout/transitions/writer"] == r["rollout/transitions/rewriter"] == 12 and r["rollout/base_calls"] == 12
        assert r["rollout/transitions"] == 24 and "train/loss" not in r
        assert r["train/writer/num_transitions"] + r["train/writer/num_skipped"] == 12
        assert all(isinstance(r[f"train/{p}/{k}"], float) for p in ("writer", "rewriter") for k in ("loss", "lr"))


def test_two_policies_both_adapters_change_and_the_base_stays(two_policy_run):
    from safetensors.torch import load_file

    d, first, second = two_policy_run
    assert set(second.adapters) == {"writer", "rewriter"} and second.adapter is None
    assert second.adapters["writer"] == d / "run/checkpoints/iter-00002/trainer/adapters/writer"
    trainer_dir = d / "run/checkpoints/iter-00002/trainer"
    assert {p.name for p in trainer_dir.iterdir()} >= {"optimizer-writer.pt", "optimizer-rewriter.pt",
                                                       "scheduler-writer.pt", "scheduler-rewriter.pt"}
    for name, rank in (("writer", 8), ("rewriter", 4)):
        one, two = (load_file(d / f"run/checkpoints/iter-0000{i}/trainer/adapters/{name}/adapter_model.safetensors")
                    for i in (1, 2))
        assert one and all("lora_" in k for k in one)  # the adapter only: no base weight is saved, or trained
        assert any(v.abs().max() > 0 for k, v in one.items() if "lora_B" in k)  # LoRA B starts at zero
        assert any(not torch.equal(one[k], two[k]) for k in one)  # the resumed update moved it again
        assert {v.shape[0] for k, v in one.items() if "lora_A" in k} == {rank}
    # resume restored both optimizers: their step counts went on from the checkpoint's
    for name in ("writer", "rewriter"):
        state = torch.load(trainer_dir / f"optimizer-{name}.pt")["state"]
        assert {int(s["step"]) for s in state.values()} == {4}  # 2 updates x train.epochs = 2 (tiny defaults)


def test_eval_trained_serves_every_policys_adapter(two_policy_run):
    from click.testing import CliRunner

    from lightning_sdk.cli import main

    d, _, _ = two_policy_run
    args = ["eval", "--trained", "--run-dir", str(d / "run"), "--data", str(d / "train.jsonl"), "--limit", "3"]
    out = CliRunner().invoke(main, ["eval", "-c", str(d / "lightning.toml"), *args[1:]])
    assert out.exit_code == 0, out.output
    text = out.output.replace("\n", "")
    assert "writer=duo-writer-iter2, rewriter=duo-rewriter-iter2" in text  # each adapter named by its iteration
    assert "of iteration 2 (checkpoint " in text and "iter-00002, served as writer=duo-writer-iter2" in text
    # A config without the run's [policies] cannot serve them: one line, exit 2.
    single = d / "single.toml"
    single.write_text((d / "lightning.toml").read_text().split("[policies.writer]")[0])
    out = CliRunner().invoke(main, ["eval", "-c", str(single), *args[1:]])
    assert out.exit_code == 2 and "the config needs their [policies]" in out.output.replace("\n", "")
