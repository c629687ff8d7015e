"""graphamp's AMP passes (``graphamp.passes``).

Each pass is one file with one verb-named function ``fn(gm, ctx) -> PassResult(gm, modified)``.
The pipeline order lives in ``amp_pipeline.AMP_PIPELINE``; the invariants in ``README.md``.
"""

from .amp_pipeline import AMP_PIPELINE, AmpPassError, pass_settings, run_amp_passes
from .base import AmpContext, PassResult
from .colour import colour_by_lists
from .fold_casts import fold_cast_chains
from .hoist_param_casts import hoist_parameter_casts
from .insert_casts import dtype_after_amp, insert_casts
from .lint import AmpInvariantError, check_amp_invariants, verify_dtypes
from .lists import DEFAULT_LISTS, PrecisionLists, resolve_op
from .remove_hints import remove_hints

__all__ = [
    "AMP_PIPELINE",
    "AmpContext",
    "AmpInvariantError",
    "AmpPassError",
    "DEFAULT_LISTS",
    "PassResult",
    "PrecisionLists",
    "check_amp_invariants",
    "colour_by_lists",
    "dtype_after_amp",
    "fold_cast_chains",
    "hoist_parameter_casts",
    "insert_casts",
    "pass_settings",
    "remove_hints",
    "resolve_op",
    "run_amp_passes",
    "verify_dtypes",
]
