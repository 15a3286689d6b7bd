"""Which distribution this is, what its `train` extra adds, and the one that must not share its environment.

The import package `lightning_sdk` and the `lightning` command are this project's, but the name `lightning-sdk` on
the package index is Lightning AI's Studios SDK, whose wheel installs the same `lightning_sdk/` package and the
same `lightning` script. This project's distribution is therefore named DISTRIBUTION; an installed `lightning-sdk`
that ships files into `lightning_sdk/` is the other one (an editable install of this project under its old name
ships none: only a .pth finder).
"""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "lightning-agent-rl"
VERSION = "0.1.0"  # the distribution's too (pyproject.toml reads it)
OTHER = "lightning-sdk"


# What the `train` extra installs, by import name: an environment without them (a worker's) has the agent side only.
TRAIN_MODULES = frozenset({"torch", "transformers", "peft", "accelerate", "tokenizers", "safetensors", "fastapi",
                           "starlette", "uvicorn", "uvloop", "httptools", "orjson", "tensorboard",
                           "matplotlib", "numpy", "xgrammar"})


def missing_train_extra(error: ImportError, what: str) -> str | None:
    """The one line for `what` (a command) failing to import a module of the `train` extra; None for other errors."""
    name = (error.name or "").partition(".")[0]
    if name not in TRAIN_MODULES:
        return None
    return (f"{what} needs the `train` extra ({name} is not installed; this environment has the agent side only, "
            f"enough for `lightning worker`): pip install torch==2.13.0 && pip install '{DISTRIBUTION}[train]'")


def other_distribution() -> str | None:
    """'lightning-sdk <version>' when the other distribution is installed beside this package, else None."""
    for dist in importlib.metadata.distributions(name=OTHER):
        if any(f.parts[:1] == ("lightning_sdk",) for f in dist.files or ()):
            return f"{OTHER} {dist.version}"
    return None


def conflict_line() -> str | None:
    """The one line `import lightning_sdk` and `lightning` print when the other distribution is installed."""
    other = other_distribution()
    if other is None:
        return None
    return (f"lightning_sdk: {other} (Lightning AI's Studios SDK) is installed in this environment and writes the "
            f"same lightning_sdk/ package and `lightning` command as {DISTRIBUTION}; the two cannot share an "
            f"environment: `pip uninstall {OTHER}` and reinstall {DISTRIBUTION}, or use separate virtual environments")
