"""How failed rollouts are told to a person: counted, grouped by what went wrong, each group once, bounded to one
line, with the line of the user's own code that raised.

Rollouts of one batch usually fail for one reason, and their messages differ only in the rollout id: a list of
them reads as many problems. `summary` groups them; `user_line` finds the frame worth reading in a traceback.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from lightning_sdk.console import printable

__all__ = ["MAX_ERROR_CHARS", "first_line", "summary", "user_line"]

MAX_ERROR_CHARS = 240  # one error as shown in a line: an exception whose str() is a dump of prompts stays readable
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)$')
# What makes messages of one fault differ: the rollout's id (it0003-001-2-ab12cd34, eval-trained-0004-..., check-...)
_ROLLOUT_ID = re.compile(r"\b(?:it\d{4}|eval-\w+|check)-[\w-]*[0-9a-f]{8}(?:-r\d+)?\b")
_HEX_ID = re.compile(r"\b(?=[0-9a-f]*\d)[0-9a-f]{8,}\b")  # a task id (data.task_id), a trace id


def first_line(error: str, limit: int = MAX_ERROR_CHARS) -> str:
    """An error's first non-empty line, cut to `limit` characters (an exception that embeds other exceptions, or a
    whole prompt, says its kind and start there)."""
    line = next((s.strip() for s in error.splitlines() if s.strip()), "")
    # control characters escaped (console.printable): agent text must not forge a line or drive the terminal
    return printable(line if len(line) <= limit else line[:limit - 1] + "…", None)


def summary(errors: Iterable[tuple[str | None, str | None]], *, kinds: int = 2) -> str:
    """(error, traceback) of failed rollouts as one line: the most frequent faults first, each once with how many
    rollouts it failed and where the user's code raised, e.g.
    "12 x RuntimeError: agent blew up (agent.py:31 in solve); 1 x TimeoutError: ...". Rollout ids are left out of
    the grouping (shown as <rollout>), and so are task and trace ids (<id>)."""
    counts: Counter[str] = Counter()
    where: dict[str, str] = {}
    for error, tb in errors:
        key = _HEX_ID.sub("<id>", _ROLLOUT_ID.sub("<rollout>", first_line(error or "no error recorded")))
        counts[key] += 1
        if key not in where:
            line = user_line(tb)
            if line:
                where[key] = line.split(": ", 1)[0]  # file:line in fn
    parts = [f"{n} x {key}" + (f" ({where[key]})" if key in where else "") for key, n in counts.most_common(kinds)]
    rest = sum(counts.values()) - sum(n for _, n in counts.most_common(kinds))
    return "; ".join(parts) + (f"; {rest} more of {len(counts) - kinds} other kind(s)" if rest else "")


def user_line(traceback: str | None) -> str | None:
    """The innermost frame of a stored traceback in the user's own code (not this package, not an installed library
    or the standard library), as 'file.py:12 in fn: the line'."""
    if not traceback:
        return None
    lines = traceback.splitlines()
    ours = str(Path(__file__).parent)  # this package
    library = (ours, sys.prefix, sys.base_prefix, "<frozen")
    found = None
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m and not m["file"].startswith(library) and "site-packages" not in m["file"]:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            found = f"{Path(m['file']).name}:{m['line']} in {m['fn']}" + (f": {code}" if code else "")
    return found


# Why a call cannot train, and what to change (transitions.to_transitions' reasons); "setting:<name>" and
# "other_component" are worded apart.
FIXES = {
    "greedy": ("the agent's LLM calls are greedy (temperature 0): an argmax is not a sample of the policy",
               "sample in its training calls: temperature > 0, e.g. 1.0"),
    "n>1": ("the agent's LLM calls ask for several choices (n > 1): which one it acted on is unknown",
            "make one call per sample (n = 1)"),
    "failed_call": ("every LLM call failed", "see the error in the table; a prompt over the context needs a shorter "
                    "prompt, fewer max_tokens or a larger serve.max_model_len"),
    "bad_token_ids": ("the server returned no usable token ids for the calls",
                      "serve with the built-in server or vLLM >= 0.10.2 (they return token ids)"),
}
NOT_CALL_REASONS = ("no_llm_call", "unassigned_reward", "bad_reward")  # about the rollout, not one of its calls


def cannot_train(reasons: Counter, components: list[str], seen: list[str],
                 call_error: str | None = None) -> tuple[str, str]:
    """Why no LLM call of a batch can train, and the fix, from the calls left out by reason (the most frequent
    decides): `components` is rollout.components, `seen` the components the calls named."""
    calls = Counter({k: v for k, v in reasons.items() if k not in NOT_CALL_REASONS and v})
    top = calls.most_common(1)[0][0] if calls else "failed_call"
    if top == "other_component":
        return (f"none of the LLM calls is of rollout.components = {components} (their components: "
                f"{seen or 'none named'})", "set rollout.components to the component(s) to train, or leave it "
                "empty to train every call")
    if top.startswith("setting:"):
        name = top.partition(":")[2]
        return (f"the agent's LLM calls set {name}, which the trainer cannot reproduce",
                f"leave {name} out of the agent's calls while it trains")
    why, fix = FIXES.get(top, FIXES["failed_call"])
    if top == "failed_call" and call_error:
        why += f" (first: {first_line(call_error)})"
    return why, fix


def fix_for_failure(error: str | None, where: str | None) -> str:
    """The fix for a rollout that failed with `error` (as episode.run_rollout words it), raised at `where`."""
    at = f" ({where.split(': ', 1)[0]})" if where else ""  # file:line in fn; the table shows the code
    if error and error.startswith("RewardError: @reward returned"):
        return "make @reward return a float on every path (it returned something else: see the error)"
    if error and error.startswith("@reward raised"):
        return f"fix @reward where it raised{at}"
    if error and error.startswith("TimeoutError:"):
        return "make the rollout finish within rollout.timeout, or raise rollout.timeout"
    return f"fix the agent where it raised{at}"
