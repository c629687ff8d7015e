"""What the user sees when a stage of the pipeline fails on something torch raised.

Every exception from capture, the AMP passes, planning, assembly or compilation reaches the
user as a graphamp error (``build._Stages.run`` is the one place that converts): it names the
stage, the user's line where the failure has one (the innermost frame of the traceback outside
torch and graphamp), torch's message, and what to try. torch's exception stays attached as
``__cause__``. Ctrl-C, out-of-memory errors and graphamp's own errors pass through untouched:
they already say what they mean, and callers catch them by type.
"""

from __future__ import annotations

import torch

from ..errors import CaptureError, CompileError, GraphampError
from ..records.spec import GraphSpec
from ..records.stage_names import Stage
from ..step.components import COMPONENTS
from ..torchkit.fxutil import user_frame_of_exception

PASS_THROUGH = (GraphampError, MemoryError, torch.OutOfMemoryError)

# stage -> (what was being done, what to try)
_STAGE_WORDS: dict[Stage, tuple[str, str]] = {
    Stage.CAPTURE: (
        "capturing {name}.build()",
        "build() runs eagerly first? If it does, the failing call is one graphamp cannot "
        "trace on fake tensors: move it out of build() or report it",
    ),
    Stage.AMP_PASSES: (
        "the AMP passes on {name}",
        "keep the module involved in fp32 (config.pin_fp32) or turn AMP off to check, "
        "and report it with g.dump(path)",
    ),
    Stage.PLAN: (
        "planning the training step of {name}",
        "check the optimizers' param groups; if they are ordinary, report it",
    ),
    Stage.ASSEMBLE: (
        "assembling the training step of {name}",
        "report it with g.dump(path)",
    ),
    Stage.EXAMPLES: (
        "making the example inputs of {name}'s step",
        "report it with g.dump(path)",
    ),
    Stage.STEP_CACHE: (
        "looking the step of {name} up in the step cache",
        "config.set_step_cache(False) builds the step without it; please report it",
    ),
    Stage.RECOMPUTE: (
        "copying the activation-checkpointed regions of {name}",
        "config.enable_activation_checkpointing() with no argument builds the step without "
        "recomputation; please report it with g.dump(path)",
    ),
    Stage.OUTLINE: (
        "outlining the repeated blocks of {name}",
        "config.set_outline_blocks(False) builds the step inlined; please report it",
    ),
    Stage.PLACE_COLLECTIVES: (
        "placing the ZeRO-3 gathers and scatters of {name}'s step",
        "config.enable_zero(stage=2) trains without sharded parameters; please report it "
        "with g.dump(path)",
    ),
    Stage.SAVE_STEP: (
        "saving the step of {name} in the step cache",
        "check that the cache directory is writable, or config.set_step_cache(False)",
    ),
    Stage.COMPILE: (
        "compiling the step of {name} with the {backend!r} backend",
        "try config.set_backend('aot_eager') or 'eager' to see whether the backend is "
        "at fault, and report it to torch with the step graph (g.dump(path))",
    ),
}


def stage_error(spec: GraphSpec, stage: Stage, error: Exception) -> GraphampError:
    """The graphamp error for ``error``, raised by ``stage`` of the build of ``spec``."""
    doing, fix = _STAGE_WORDS[stage]
    doing = doing.format(name=spec.name, backend=spec.config.backend)
    frame = user_frame_of_exception(error)
    at = f" at {frame}" if frame is not None else ""
    if stage is Stage.ASSEMBLE:
        doing += _step_part(error)
        fix = _assembly_fix(error, frame is not None)
    kind = CompileError if stage is Stage.COMPILE else CaptureError
    return kind(f"{doing} failed{at}: {type(error).__name__}: {error}. {fix}")


# the file of graphamp's step assembly a failure was raised under -> the part of the step
_STEP_PARTS = {
    "gradients.py": "the backward",
    "optimizer_update.py": "the optimizer update",
    "update_math.py": "the optimizer update",
    "block_update.py": "the optimizer update",
    **{f"{type(c).__module__.rsplit('.', 1)[-1]}.py": c.part for c in COMPONENTS},
}


def _step_part(error: BaseException) -> str:
    """' (<part of the step>)': the innermost part of assembly the traceback passed through."""
    part = ""
    tb = error.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if "/graphamp/step/" in path:
            part = _STEP_PARTS.get(path.rsplit("/", 1)[-1], part)
        tb = tb.tb_next
    return f" ({part})" if part else ""


def _assembly_fix(error: BaseException, in_user_code: bool) -> str:
    if in_user_code:  # the user's Python that assembly runs: a custom Function's backward, a hook
        return (
            "the code named runs during assembly (a custom autograd Function's backward or a "
            "hook): check that it works eagerly; otherwise report it with g.dump(path)"
        )
    if "SymInt" in str(error) or "symbolic" in str(error).lower():
        return (
            "the step was traced with sizes as symbols (changing shapes): "
            "config.set_dynamic_shapes(False) compiles a step per size instead; please report "
            "it with g.dump(path)"
        )
    return "this is graphamp's own failure: please report it with g.dump(path)"
