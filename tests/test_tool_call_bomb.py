"""The tool-call bomb in a real run (in-process Runtime, tiny model, real server, gateway and store): one agent
sends an assistant message whose tool-call arguments nest 1,200 `[` deep (2.4 KB). The run goes on and ends;
that call fails alone (the server cannot read its arguments: 400, recorded failed, its text kept) and every
other call trains."""

from __future__ import annotations

import io
import json

from rich.console import Console

from lightning_sdk import config
from lightning_sdk.runtime import Runtime
from lightning_sdk.store import Store

AGENT = '''
from openai import AsyncOpenAI
import lightning_sdk as ls

BOMB = "[" * 1200 + "]" * 1200

@ls.rollout
async def solve(task, llm):
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0) as client:
        if task.get("bomb"):
            try:
                await client.chat.completions.create(model=llm.model, max_tokens=2, messages=[
                    {"role": "user", "content": task["question"]},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "add", "arguments": BOMB}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "4"}])
            except Exception:
                pass
        out = await client.chat.completions.create(model=llm.model, max_tokens=4,
                                                   messages=[{"role": "user", "content": task["question"]}])
    return out.choices[0].message.content or ""

@ls.reward
def score(task, output):
    return float(output.strip() == task["answer"])
'''


def test_a_tool_call_bomb_fails_its_own_call_and_the_run_ends_well(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    rows = [{"question": f"What is {a} + 2?", "answer": str(a + 2), **({"bomb": True} if a == 1 else {})}
            for a in range(1, 3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "lightning.toml").write_text(
        '[run]\nname = "bomb"\ndir = "run"\niterations = 1\n[agent]\nmodule = "agent.py"\n'
        '[data]\ntrain = "train.jsonl"\ntasks_per_iteration = 2\ngroup_size = 2\nshuffle = false\n'
        '[model]\ndtype = "float32"\n[rollout]\nconcurrency = 4\ntimeout = 60.0\n'
        '[train]\nlora_r = 4\nmicro_batch_size = 16\n')
    out = io.StringIO()
    Runtime(config.load(tmp_path / "lightning.toml"), console=Console(file=out, width=200)).run()  # no RunError
    (m,) = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()
            if "rollout/reward_mean" in line]
    assert m["rollout/failed"] == 0 and m["rollout/rollouts"] == 4, out.getvalue()
    store = Store(tmp_path / "run/store.sqlite", read_only=True)
    calls = [s for r in store.rollouts(phase="train") for s in store.spans(r.rollout_id) if s.source == "gateway"]
    bombs = [c for c in calls if "[[[[" in c.attributes.get("gen_ai.input.messages", "")]
    assert len(calls) == 6 and len(bombs) == 2, [c.name for c in calls]
    assert [c.status for c in bombs] == ["ERROR", "ERROR"], [c.status_message for c in bombs]  # that call failed
    assert all("nested too deeply" in c.status_message for c in bombs)
    plain = [c for c in calls if c not in bombs]
    assert [c.status for c in plain] == ["OK"] * 4
    assert m["rollout/transitions"] == len(plain)  # every other call trained
    assert (tmp_path / "run/checkpoints/iter-00001").is_dir()
