"""The house rules, checked on the source: no import circle, no arrow that runs back up the data flow
(agent -> tracing -> store -> transitions/credit -> trainer -> serving, the runtime on top), one collector per
runtime the config accepts."""

import ast
import typing
from pathlib import Path

import lightning_sdk
from lightning_sdk import config
from lightning_sdk.rollouts.collector import RUNTIMES

PKG = Path(lightning_sdk.__file__).parent

# Top-level part -> its height. A module may import only parts at its height or below.
HEIGHT = {
    "errors": 0, "files": 0, "distribution": 0, "compat": 0, "drain": 0, "heap": 0, "advantage": 0,
    "metric_names": 0,                             # the one name of each logged number: read by every writer and reader
    "console": 1, "summary": 1, "config": 1, "data": 1,
    "constraint": 1,                               # what a request asks the sampler to follow: read by the gateway
    "placement": 1,                                # which GPUs serve and train: a function of the config
    "agent": 2, "tracing": 3,                      # the agent side: no store, trainer or server below them
    "gateway": 3,                                  # makes each call's record; the store keeps it
    "evals": 1,                                    # what an eval score says: below the table and the metrics
    "failures": 1,                                 # how failed rollouts are told: read by the loop and check
    "store": 4, "credit": 5, "transitions": 6, "models": 5,
    "grammar": 6,                                  # a constraint compiled: the sampler's mask and the trainer's replay
    "memory": 6,                                   # a run's memory on paper: the config and the model's shape
    "train": 7, "engine": 7, "servers": 7, "metrics": 7,
    "rollouts": 8, "pipeline": 8, "runtime": 9, "production": 9, "check": 10, "cli": 10, "dashboard": 10, "api": 11,
}
AGENT_SIDE = {"agent", "tracing"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every lightning_sdk module `name` imports, at any depth of its code (lazy imports count too)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lightning_sdk")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("lightning_sdk"):
                continue
            for a in node.names:  # `from pkg import submodule` is an import of the submodule
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return found - {name}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_import_circle():
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) & set(mods) for m, p in mods.items()}
    done, stack = set(), []

    def visit(m: str) -> None:
        if m in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in done:
            return
        stack.append(m)
        for n in sorted(graph[m]):
            visit(n)
        stack.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_no_arrow_runs_back_up():
    mods = _modules()
    wrong = []
    for m, p in mods.items():
        src = _part(m)
        if src == "__init__":  # the public surface: the agent side only
            # plus `run` (api), imported only when asked for, and the distribution check
            allowed = lambda dst: dst in AGENT_SIDE | {"api", "distribution"}  # noqa: E731
        else:
            assert src in HEIGHT, f"{m}: a new top-level part; give it a height in this test"
            allowed = lambda dst, src=src: dst == src or HEIGHT[dst] <= HEIGHT[src]  # noqa: E731
        for target in _imports(m, p, set(mods)):
            dst = _part(target)
            if dst != "__init__" and not allowed(dst):
                wrong.append(f"{m} imports {target}")
            if src in AGENT_SIDE and dst not in AGENT_SIDE | {"errors", "files", "compat", "drain", "__init__"}:
                wrong.append(f"{m} (agent side) imports {target}")
    assert not wrong, wrong


def test_every_runtime_the_config_accepts_has_one_collector():
    accepted = set(typing.get_args(config.RunConfig.model_fields["runtime"].annotation))
    assert accepted == set(RUNTIMES)


def test_the_runtimes_whose_agent_runs_elsewhere_agree_with_their_collectors():
    """config.AGENT_ELSEWHERE makes [agent] optional; the collector's `runs_agent` keeps the runtime from importing
    the agent module. One list, said twice: they must agree."""
    from lightning_sdk.rollouts.collector import runs_agent

    assert {rt for rt in RUNTIMES if not runs_agent(rt)} == set(config.AGENT_ELSEWHERE)
    for rt in RUNTIMES:
        data = {"run": {"runtime": rt}, "data": {"train": "t.jsonl"}}
        if rt in config.AGENT_ELSEWHERE:
            assert config.parse(data).agent is None
        else:
            try:
                config.parse(data)
            except config.ConfigError as e:
                assert str(e).startswith("agent: required key is missing")
            else:
                raise AssertionError(f"run.runtime = {rt!r} without [agent] was accepted")


def test_core_dependencies_are_ranges_and_ci_tests_their_lower_bounds():
    """Every core (agent-side) dependency is a range, never `==`; .ci/lowest.txt installs exactly each lower
    bound, and CI runs the agent-side tests there."""
    import re
    import tomllib

    root = PKG.parent
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    lowest = dict(line.split("==") for line in (root / ".ci" / "lowest.txt").read_text().splitlines()
                  if "==" in line and not line.startswith("#"))
    for dep in deps:
        name, spec = re.match(r"([A-Za-z0-9_.-]+)(.*)", dep).groups()
        assert "==" not in spec, dep
        low = re.search(r">=\s*([0-9][^,\s]*)", spec)
        assert low, f"{dep}: no lower bound"
        assert lowest.get(name) is not None, f"{name} is not in .ci/lowest.txt"
        assert tuple(map(int, lowest[name].split("."))) >= tuple(map(int, low.group(1).split("."))), name
        padded = low.group(1) + ".0" * (3 - low.group(1).count(".") - 1)
        assert lowest[name] == padded or lowest[name] == low.group(1), (name, lowest[name], low.group(1))


def test_no_private_name_crosses_a_file_boundary():
    """`from x import _name` across files: a private name is its module's own (the house rule)."""
    wrong = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_sdk"):
                wrong += [f"{name} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not wrong, wrong


def test_no_two_modules_share_a_name():
    names = [m.rsplit(".", 1)[-1] for m, p in _modules().items() if p.name not in ("__init__.py", "__main__.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


# Inside the runtime, one room per idea and data flowing one way: the loop on top, the rooms it uses below it,
# each importing only rooms lower than itself.
RUNTIME_ROOMS = {
    "feed": 0, "handover": 0, "preflight": 0, "resume": 0, "launch": 0, "session": 0,
    "iteration": 1, "evaluation": 1,
    "loop": 2, "__init__": 3,
}


def test_the_runtime_rooms_import_downward_only():
    mods = _modules()
    rooms = {m: p for m, p in mods.items() if m == "lightning_sdk.runtime" or m.startswith("lightning_sdk.runtime.")}
    room = lambda m: "__init__" if m == "lightning_sdk.runtime" else m.rsplit(".", 1)[-1]  # noqa: E731
    assert {room(m) for m in rooms} == set(RUNTIME_ROOMS), "a new runtime module: give it a height in this test"
    wrong = [f"{m} imports {t}" for m, p in rooms.items() for t in _imports(m, p, set(mods))
             if t in rooms and RUNTIME_ROOMS[room(t)] >= RUNTIME_ROOMS[room(m)]]
    assert not wrong, wrong


def test_the_training_loop_reads_on_one_screen():
    """collect, update, save and hot-load: the loop of `lightning run` in one short function, the rooms apart."""
    tree = ast.parse((PKG / "runtime" / "loop.py").read_text())
    [loop] = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_train"]
    assert loop.end_lineno - loop.lineno + 1 <= 30
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PKG / "runtime").glob("*.py")}
    assert max(sizes.values()) <= 300, sizes
