"""What the user sees when a stage of the pipeline fails on something torch raised.

Every exception from capture, the AMP passes, planning, assembly or compilation reaches the
user as a graphamp error (pipeline.build_program is the one place that converts): it names the
stage, the user's line where the failure has one (the innermost frame of the traceback outside
torch and graphamp), torch's message, and what to try. torch's exception stays attached as
``__cause__``. Ctrl-C, out-of-memory errors and graphamp's own errors pass through untouched:
they already say what they mean, and callers catch them by type.
"""

from __future__ import annotations

import torch

from ..errors import CaptureError, CompileError, GraphampError
from .fxutil import user_frame_of_exception
from .spec import GraphSpec

PASS_THROUGH = (GraphampError, MemoryError, torch.OutOfMemoryError)

# stage -> (what was being done, what to try)
_STAGE_WORDS = {
    "capture": (
        "capturing {name}.build()",
        "build() runs eagerly first? If it does, the failing call is one graphamp cannot "
        "trace on fake tensors: move it out of build() or report it",
    ),
    "amp_passes": (
        "the AMP passes on {name}",
        "keep the module involved in fp32 (config.pin_fp32) or turn AMP off to check, "
        "and report it with g.dump(path)",
    ),
    "plan": (
        "planning the training step of {name}",
        "check the optimizers' param groups; if they are ordinary, report it",
    ),
    "assemble": (
        "assembling the training step of {name}",
        "a custom autograd Function's backward or a hook runs here: check that it "
        "works eagerly; otherwise report it with g.dump(path)",
    ),
    "compile": (
        "compiling the step of {name} with the {backend!r} backend",
        "try config.set_backend('aot_eager') or 'eager' to see whether the backend is "
        "at fault, and report it to torch with the step graph (g.dump(path))",
    ),
}


def stage_error(spec: GraphSpec, stage: str, error: Exception) -> GraphampError:
    """The graphamp error for ``error``, raised by ``stage`` of the build of ``spec``."""
    doing, fix = _STAGE_WORDS.get(stage, _STAGE_WORDS["assemble"])
    doing = doing.format(name=spec.name, backend=spec.config.backend)
    frame = user_frame_of_exception(error)
    at = f" at {frame}" if frame is not None else ""
    kind = CompileError if stage == "compile" else CaptureError
    return kind(f"{doing} failed{at}: {type(error).__name__}: {error}. {fix}")
