"""Exceptions graphamp raises. Each message names what is wrong and how to fix it."""

from __future__ import annotations


class GraphampError(Exception):
    """Base class of every error graphamp raises on purpose. A refusal's message ends with the
    section of ``docs/refusals.md`` for its family: why, and what to do."""

    family = ""  # its section of docs/refusals.md ("" for none)

    def __str__(self) -> str:
        text = super().__str__()
        if not self.family or "docs/refusals.md" in text:
            return text
        return f"{text}\n(what to do when graphamp refuses: docs/refusals.md#{self.family})"


class GraphDefinitionError(GraphampError, TypeError):
    """The Graph subclass is set up wrongly (missing super().__init__(), bad registration)."""

    family = "graph-definition"


class CaptureError(GraphampError, RuntimeError):
    """build() could not be captured as a graph; the message names the user's source line."""

    family = "capture"


class UnsupportedOptimizerError(GraphampError, TypeError):
    """The optimizer (or one of its options) cannot be one update inside the step."""

    family = "optimizers"


class ConfigError(GraphampError, ValueError):
    """A config setter or scaler got an invalid value."""

    family = "settings"


class InputError(GraphampError, TypeError):
    """g(...) was called with arguments that do not fit build()."""

    family = "inputs"


class CompileError(GraphampError, RuntimeError):
    """The torch.compile backend failed on the assembled step."""

    family = "compile"


class RecompileLimitError(GraphampError, RuntimeError):
    """Calls keep breaking what the compiled steps assume: more builds than
    ``config.set_recompile_limit`` allows for one model and config."""

    family = "recompiles"


class RankFailedError(GraphampError, RuntimeError):
    """Data parallel: another rank's call failed, and this rank's step stopped in the
    collectives that rank never joined. Names the rank and its error."""

    family = "data-parallel"
