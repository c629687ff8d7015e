"""graphamp: OneFlow-style graph-compiled automatic mixed precision for PyTorch.

Subclass ``graphamp.Graph``, register a model, loss and optimizer, enable AMP, write the training
step once in ``build()``; graphamp captures it with torch.fx, colours the graph by precision
lists, inserts the fewest casts, adds an in-graph grad scaler and compiles the whole step.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def _load_passes_from_source_tree() -> None:
    """Installed, ``passes/`` is ``graphamp.passes``; in a plain checkout it sits beside us."""
    here = os.path.dirname(os.path.abspath(__file__))
    source = os.path.join(os.path.dirname(here), "passes")
    spec = importlib.util.spec_from_file_location(
        "graphamp.passes",
        os.path.join(source, "__init__.py"),
        submodule_search_locations=[source],
    )
    if spec is None or spec.loader is None:
        raise ImportError("graphamp.passes is missing: reinstall graphamp (pip install -e .)")
    module = importlib.util.module_from_spec(spec)
    sys.modules["graphamp.passes"] = module
    spec.loader.exec_module(module)


if importlib.util.find_spec("graphamp.passes") is None:
    _load_passes_from_source_tree()
from . import (
    config,  # noqa: E402
    passes,  # noqa: E402,F401
)
from .config import GraphConfig  # noqa: E402
from .errors import (  # noqa: E402
    CaptureError,
    CompileError,
    ConfigError,
    GraphampError,
    GraphDefinitionError,
    InputError,
    UnsupportedOptimizerError,
)
from .graph import Graph  # noqa: E402
from .ops import full_precision, low_precision  # noqa: E402
from .pins import AmpPin  # noqa: E402
from .scaler import GradScaler, StaticGradScaler  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AmpPin",
    "CaptureError",
    "CompileError",
    "ConfigError",
    "GradScaler",
    "Graph",
    "GraphConfig",
    "GraphDefinitionError",
    "GraphampError",
    "InputError",
    "StaticGradScaler",
    "UnsupportedOptimizerError",
    "config",
    "full_precision",
    "low_precision",
    "passes",
]
