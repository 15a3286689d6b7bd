"""The agent-side API: `@rollout`, `@reward` and the `LLM` handle. Plain functions stay plain.

The decorators only mark a function so `lightning run` can find it; calling it yourself just runs your agent.
`load_agent` finds the two in the agent's module, `run_environment` is what a run sets in the agent's process,
and `reward_value` is the one check every reward passes (`@reward`'s return value and `emit_reward`'s argument
alike). This module (like `tracing.context`) imports no torch and no server code, so the agent's environment stays
light.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import numbers
import logging
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from lightning_sdk.compat import drop_agents_sdk_client
from lightning_sdk.errors import SetupError
from lightning_sdk.files import load_py_file

log = logging.getLogger("lightning_sdk")

F = TypeVar("F", bound=Callable[..., Any])

# The largest |reward| a run takes. Far beyond any score's scale, yet a group's std of rewards this size stays
# finite (squares of ~1e155 overflow a float64, and every advantage would silently become 0).
MAX_ABS_REWARD = 1e6

ROLLOUT_MARK = "__lightning_rollout__"
REWARD_MARK = "__lightning_reward__"


@dataclass(frozen=True)
class LLM:
    """Where the agent sends its LLM calls during training: the runtime's OpenAI-compatible server.

    `model` names the policy being trained (the newest adapter), so it changes between iterations.
    `sampling` holds the run's suggested sampling settings, for agents that want them.
    """

    base_url: str
    api_key: str
    model: str
    sampling: dict[str, Any] = field(default_factory=dict)


def _arity(fn: Callable, accepted: tuple[int, ...], what: str, shape: str) -> int:
    """How many positional arguments `fn` is called with: the largest of `accepted` that it takes."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return max(accepted)
    params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
        return max(accepted)
    required = sum(p.default is p.empty for p in params)
    fits = [n for n in accepted if required <= n <= len(params)]
    if not fits:
        raise TypeError(f"@{what} {fn.__qualname__}{sig}: expected {shape}")
    return max(fits)


def rollout(fn: F) -> F:
    """Mark `fn(task)` or `fn(task, llm)` (sync or async) as one episode of the agent; its return value goes to
    `@reward`. Without the `llm` argument the agent builds its OpenAI client as it always does (`OpenAI()`): during
    a run the environment points it at the run's server (see `redirect_openai`)."""
    setattr(fn, ROLLOUT_MARK, _arity(fn, (1, 2), "rollout", "fn(task) or fn(task, llm)"))
    return fn


def reward(fn: F) -> F:
    """Mark `fn(task, output) -> float` (sync or async) as the episode's score."""
    _arity(fn, (2,), "reward", "fn(task, output)")
    setattr(fn, REWARD_MARK, True)
    return fn


def rollout_args(fn: Callable, task: Any, llm: LLM) -> tuple:
    """The arguments `fn` (a @rollout) is called with: (task, llm), or (task) for `fn(task)`."""
    return (task, llm) if getattr(fn, ROLLOUT_MARK, 2) == 2 else (task,)


def is_rollout(obj: Any) -> bool:
    return callable(obj) and getattr(obj, ROLLOUT_MARK, None) in (1, 2)


def is_reward(obj: Any) -> bool:
    return callable(obj) and getattr(obj, REWARD_MARK, False) is True


def output_json(output: Any) -> str:
    """A rollout's output as JSON (the store's column, a remote worker's report); one JSON cannot hold (a list
    that contains itself, a dict with tuple keys) is kept as its repr, so recording it never fails the rollout,
    let alone the run."""
    try:
        return json.dumps(output, default=str)
    except (TypeError, ValueError, RecursionError):
        try:
            return json.dumps(repr(output))
        except Exception:  # noqa: BLE001 - a __repr__ that raises: the type is all that is left
            return json.dumps(f"<{type(output).__name__} that neither JSON nor repr() can show>")


# What a run puts in the agent process's environment. OPENAI_BASE_URL / OPENAI_API_KEY are what the openai client
# (and LangChain's ChatOpenAI, AutoGen's and the Agents SDK's clients, all built on it) read when built without
# arguments; OPENAI_API_BASE is LangChain's older name, which it prefers when set. The Agents SDK uploads its own
# traces to OpenAI by default: offline that fails, online it sends the prompts out; a run turns it off.
QUIET_ENV = {"OPENAI_AGENTS_DISABLE_TRACING": "1"}


@contextlib.contextmanager
def run_environment(base_url: str, api_key: str, *, redirect_openai: bool = True) -> Iterator[None]:
    """The agent process's environment during a run: OpenAI clients built from the environment call the run's
    server (unless `redirect_openai` is off), the Agents SDK's trace upload is off; restored on exit."""
    values = dict(QUIET_ENV)
    if redirect_openai:
        values.update(dict.fromkeys(("OPENAI_BASE_URL", "OPENAI_API_BASE"), base_url), OPENAI_API_KEY=api_key)
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    drop_agents_sdk_client()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        drop_agents_sdk_client()
        restore_reply_cache()


_cache_lock = threading.Lock()
_saved_cache: dict[str, Any] = {}  # DSPy's cache before the run turned it off, and the one it put in its place


def no_reply_cache() -> bool:
    """DSPy's LM reply cache off for the run, through its public switch (`dspy.configure_cache`), once DSPy is
    imported; True when it was turned off by this call. DSPy caches replies on disk by default: a prompt seen in
    an earlier iteration (or an earlier run) would make no call and draw no sample, and the rollout would be
    scored on an old policy's reply. The run's rollouts call this before each episode; `run_environment` puts the
    user's cache back on exit."""
    dspy = sys.modules.get("dspy")
    if dspy is None or not callable(getattr(dspy, "configure_cache", None)):
        return False
    with _cache_lock:
        if "off" in _saved_cache and getattr(dspy, "cache", None) is _saved_cache["off"]:
            return False
        _saved_cache.setdefault("user", getattr(dspy, "cache", None))
        dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
        _saved_cache["off"] = dspy.cache
    log.info("DSPy's LM reply cache is off for this run (dspy.configure_cache): a cached reply is no sample of the "
             "policy being trained")
    return True


def restore_reply_cache() -> None:
    dspy = sys.modules.get("dspy")
    with _cache_lock:
        if dspy is not None and "user" in _saved_cache and getattr(dspy, "cache", None) is _saved_cache.get("off"):
            dspy.cache = _saved_cache["user"]
        _saved_cache.clear()


class RewardError(ValueError):
    """A reward that is not a finite number within +-MAX_ABS_REWARD."""


def reward_value(value: Any, what: str, where: str = "") -> float:
    """`value` as a float if it is a finite real number within +-MAX_ABS_REWARD (bools count: `output == answer`
    is a fine reward).

    The error reads "{what} {value!r} ({type}){where}; expected ...", e.g. what="@reward returned".
    """
    if value is None:  # nothing was returned: a path through the function without `return`, not a bad number
        raise RewardError(f"{what} None{where}, expected a float: return a number (or a bool) on every path, "
                          f"e.g. `return 0.0` where it cannot score the output")
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        value = value.item()  # a numpy scalar or 0-d array, a 0-d torch tensor: its Python number
    if isinstance(value, bool) or (isinstance(value, numbers.Real) and not isinstance(value, str)):
        try:
            number = float(value)
        except (OverflowError, ValueError, TypeError):
            number = math.nan
        if math.isfinite(number) and abs(number) <= MAX_ABS_REWARD:
            return number
        if math.isfinite(number):
            raise RewardError(f"{what} {value!r} ({type(value).__name__}){where}; expected a reward within "
                              f"+-{MAX_ABS_REWARD:g}: rescale it")
    raise RewardError(f"{what} {value!r} ({type(value).__name__}){where}; expected a finite float: a finite number "
                      f"or a bool")


class AgentLoadError(SetupError):
    """Importing the agent's module failed in the user's own code: the message is one line, `traceback` the rest."""

    def __init__(self, module: str, error: BaseException):
        what = "exited (SystemExit)" if isinstance(error, SystemExit) else f"raised {type(error).__name__}"
        detail = error.msg if isinstance(error, SyntaxError) else str(error)
        super().__init__(f"agent.module = {module!r}: importing it {what}: {detail}".replace("\n", " "))
        frames = traceback.TracebackException.from_exception(error)
        # The user's frames only: importlib's and ours say nothing about their code.
        frames.stack = traceback.StackSummary.from_list(
            [f for f in frames.stack if not f.filename.startswith("<frozen") and not f.filename.startswith(_PACKAGE)])
        self.traceback = "".join(frames.format())


_PACKAGE = str(Path(__file__).parent)


def load_agent(module: str, rollout_name: str | None, reward_name: str | None) -> tuple[Callable, Callable]:
    """The agent's @rollout and @reward functions, from a .py path or a dotted module name.

    Whatever goes wrong importing it (a syntax error, an import that fails, an exception or `sys.exit()` at its
    top level, a decorated function of the wrong arity) is an AgentLoadError: one line, the user's traceback.
    """
    if not module.strip():
        raise SetupError("agent.module = '': expected a .py path or a dotted module name")
    try:
        if module.endswith(".py"):
            path = Path(module)
            if not path.is_file():
                raise SetupError(f"agent.module = {module!r}: " + ("not a file" if path.exists() else "file not found"))
            mod = load_py_file(path, f"lightning_agent_{path.stem}", importable_siblings=True)
        else:
            mod = importlib.import_module(module)
    except SetupError:
        raise
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):  # the module itself
            raise SetupError(f"agent.module = {module!r}: no module named {e.name!r} on the Python path; give a "
                             f"dotted module that can be imported, or the path of a .py file") from None
        raise AgentLoadError(module, e) from None
    except (Exception, SystemExit) as e:  # SystemExit: `sys.exit()` at import must not end `lightning run` with 0
        raise AgentLoadError(module, e) from None

    def pick(kind: str, name: str | None, test: Callable[[Any], bool]) -> Callable:
        if name is not None:
            fn = getattr(mod, name, None)
            if fn is None or not test(fn):
                raise SetupError(f"agent.{kind} = {name!r}: {module} has no @{kind} function of that name")
            return fn
        found = [v for v in vars(mod).values() if test(v)]
        if not found:
            raise SetupError(f"agent.module = {module!r}: has no @{kind} function; mark the function that "
                             + ("runs one episode with @ls.rollout" if kind == "rollout" else
                                "scores an episode with @ls.reward")
                             + " (import lightning_sdk as ls)")
        if len(found) > 1:
            names = ", ".join(f.__name__ for f in found)
            raise SetupError(f"agent.module = {module!r}: has {len(found)} @{kind} functions ({names}); name the "
                             f"one to use with agent.{kind} = {found[0].__name__!r} in [agent]")
        return found[0]

    return pick("rollout", rollout_name, is_rollout), pick("reward", reward_name, is_reward)
