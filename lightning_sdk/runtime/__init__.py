"""The runtime: `lightning run`'s loop (loop.py) on top of the rooms it uses: where a run starts from (resume.py,
preflight.py), the live services and routing (session.py), the trainer's start (launch.py), one iteration's batch
(iteration.py), evals (evaluation.py). Data flows one way: loop -> evaluation/iteration -> session."""

from lightning_sdk.errors import RunError, SetupError
from lightning_sdk.runtime.evaluation import Evaluated
from lightning_sdk.runtime.feed import TaskFeed
from lightning_sdk.runtime.handover import gpu_handover
from lightning_sdk.runtime.iteration import nothing_to_train, policy_failure
from lightning_sdk.runtime.loop import Runtime

__all__ = ["Evaluated", "RunError", "Runtime", "SetupError", "TaskFeed", "gpu_handover", "nothing_to_train",
           "policy_failure"]
