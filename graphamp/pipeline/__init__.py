"""The pipeline: the only caller of the build stages (``build.py``: one build as straight-line
code over the typed stages of ``stages.py``; ``stage_errors.py``: how each stage's failure is
worded).

The runtime hands it a GraphSpec (what was registered and configured), the call's flattened
inputs, the graph's SharedState and a BuildRequest; it returns a Program, whole. No stage reads
``Graph``; each reads the records the stages before it returned. ``docs/architecture.md`` has
the picture and the import rules.
"""

from ..step.closure_trial import python_step
from ..step.components import (
    checked_component_state,
    load_component_state,
    saved_component_state,
)
from .build import build_program, trace_autocast

__all__ = [
    "build_program",
    "checked_component_state",
    "load_component_state",
    "saved_component_state",
    "trace_autocast",
    "python_step",
]
