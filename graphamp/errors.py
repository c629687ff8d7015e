"""Exceptions graphamp raises. Each message names what is wrong and how to fix it."""

from __future__ import annotations


class GraphampError(Exception):
    """Base class of every error graphamp raises on purpose."""


class GraphDefinitionError(GraphampError, TypeError):
    """The Graph subclass is set up wrongly (missing super().__init__(), bad registration)."""


class CaptureError(GraphampError, RuntimeError):
    """build() could not be captured as a graph; the message names the user's source line."""


class UnsupportedOptimizerError(GraphampError, TypeError):
    """The optimizer (or one of its options) cannot be one update inside the step."""


class ConfigError(GraphampError, ValueError):
    """A config setter or scaler got an invalid value."""


class InputError(GraphampError, TypeError):
    """g(...) was called with arguments that do not fit build()."""


class CompileError(GraphampError, RuntimeError):
    """The torch.compile backend failed on the assembled step."""


class RecompileLimitError(GraphampError, RuntimeError):
    """Calls keep breaking what the compiled steps assume: more builds than
    ``config.set_recompile_limit`` allows for one model and config."""
