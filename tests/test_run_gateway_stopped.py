"""Issue 52 item 10: a run whose gateway process is stopped (SIGSTOP) says so, naming it, rather than failing its
rollouts one timeout at a time as if the agent were slow."""

from __future__ import annotations

from tests.projects import run_one_task

AGENT = '''
import os, signal, threading
import psutil
from openai import OpenAI
import lightning_sdk as ls

once = threading.Lock()

@ls.rollout
def solve(task, llm):
    if once.acquire(blocking=False):
        for p in psutil.Process().children():
            if "lightning_sdk.gateway.isolated" in " ".join(p.cmdline()):
                os.kill(p.pid, signal.SIGSTOP)
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=30)
    client.chat.completions.create(model=llm.model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    return "done"

@ls.reward
def score(task, output):
    return 1.0
'''


def test_a_stopped_gateway_process_is_named_not_blamed_on_rollout_timeouts(tmp_path):
    code, text = run_one_task(tmp_path, AGENT, group_size=2, timeout=5.0)
    assert code != 0, text[-3000:]
    assert "the gateway's process (pid" in text and "is stopped (SIGSTOP or SIGTSTP)" in text, text[-3000:]
