"""RolloutPipe's scheduling core for Python RL stacks.

The core is sans-IO: report what happened (``on_*`` events) and ask what to do next
(``poll_*`` decisions); time is an integer tick you pass in. It knows no model: you run the
engines, verifiers and trainer, it decides which request runs next, when a group is trained,
filtered or aborted, and counts every prompt.

    import rolloutpipe as rp
    s = rp.Scheduler(groups=64, requests=1024)
    s.begin_step(0, step=0, version=0, plan=rp.Plan(8, 4, micro_batch=2, admission="frontier"))

Every refusal raises its own exception class (``RequestError``, ``DrawError``, ...), all
subclasses of ``RolloutPipeError``, with the core's one-line message and a ``kind``
attribute naming the variant; the refused event changed nothing.

``CpuPolicy`` is the CPU reference backend (an HF Qwen3 model directory) as an engine and a
trainer; it releases the GIL around model work. ``Task`` is a built-in task's problem
generator and verifier (``add``, ``mul``, ``countdown``), the code ``rolloutpipe train`` scores with.

``train`` runs ``rolloutpipe train``'s whole job from Python, its workers in-process or behind
a ``send(route, bytes) -> bytes`` (``tracking=True`` also logs to TensorBoard under Slime's
metric names, ``rolloutpipe.tracking``); ``EngineHost``, ``TrainerHost`` and ``VerifierHost`` answer
those messages wherever the work runs. ``rolloutpipe.ray`` (needs ``ray``) runs the job on a
Ray cluster: ``python -m rolloutpipe.ray train --config F --out DIR``. ``rolloutpipe.vllm``
(needs torch, transformers and vLLM: ``scripts/vllm/setup.sh``) runs it with vLLM rollout
engines and a PyTorch trainer: ``python -m rolloutpipe.vllm train [--ray]``.
"""

from ._core import (
    ABI_VERSION,
    Admission,
    Allocated,
    AllocParamError,
    AuditError,
    BackendError,
    BeginError,
    Completion,
    Counters,
    CpuPolicy,
    Dispatch,
    EngineHost,
    DrawError,
    ExtendError,
    Failure,
    Finished,
    FixedG,
    GroupInfo,
    MicroBatch,
    PilotCommit,
    Plan,
    PlanError,
    Problem,
    RequestError,
    RequestId,
    RolloutPipeError,
    RunError,
    Scheduler,
    SlotsError,
    StepSummary,
    Task,
    TaskError,
    TrainError,
    TrainerHost,
    VerifierHost,
    Vigor,
    WireError,
    resolve_config,
    write_tiny_model,
)
from .tracking import train

__version__ = "0.1.0"

__all__ = [
    "ABI_VERSION",
    "Admission",
    "Allocated",
    "AllocParamError",
    "AuditError",
    "BackendError",
    "BeginError",
    "Completion",
    "Counters",
    "CpuPolicy",
    "Dispatch",
    "EngineHost",
    "DrawError",
    "ExtendError",
    "Failure",
    "Finished",
    "FixedG",
    "GroupInfo",
    "MicroBatch",
    "PilotCommit",
    "Plan",
    "PlanError",
    "Problem",
    "RequestError",
    "RequestId",
    "RolloutPipeError",
    "RunError",
    "Scheduler",
    "SlotsError",
    "StepSummary",
    "Task",
    "TaskError",
    "TrainError",
    "TrainerHost",
    "VerifierHost",
    "Vigor",
    "WireError",
    "resolve_config",
    "train",
    "write_tiny_model",
]
