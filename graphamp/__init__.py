"""graphamp: OneFlow-style graph-compiled automatic mixed precision for PyTorch.

Subclass ``graphamp.Graph``, register a model, loss and optimizer, enable AMP, write the training
step once in ``build()``; graphamp captures it with torch.fx, colours the graph by precision
lists, inserts the fewest casts, adds an in-graph grad scaler and compiles the whole step.
"""

from __future__ import annotations

from . import config, passes
from .config import GraphConfig
from .errors import (
    CaptureError,
    CompileError,
    ConfigError,
    GraphampError,
    GraphDefinitionError,
    InputError,
    RankFailedError,
    RecompileLimitError,
    UnsupportedOptimizerError,
)
from .graph import Graph
from .integrations.function import training_step
from .records.pins import AmpPin
from .scaler import GradScaler, StaticGradScaler
from .sharding.sharded_params import gathered_parameters
from .torchkit.ops import full_precision, low_precision

__version__ = "0.1.0"

__all__ = [
    "AmpPin",
    "CaptureError",
    "CompileError",
    "RankFailedError",
    "RecompileLimitError",
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
    "gathered_parameters",
    "low_precision",
    "passes",
    "training_step",
]
