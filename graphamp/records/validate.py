"""One way to check a user's setting: each helper raises ConfigError naming the setting, the
value it got and what it takes, and returns the value in its canonical type.

Numbers are finite unless a helper says otherwise (``allow_inf``): a NaN or an infinity in a
scale, a factor or an interval is always a mistake that would otherwise surface steps later as
a NaN loss. Python bools are refused where numbers are wanted (``True`` is an int in Python).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from ..errors import ConfigError

LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)
OPT_LEVELS = ("O0", "O1", "O2", "O3")


def dtype_name(dtype: Any) -> str:
    """``float16`` for ``torch.float16``: the short name every dump, report and log uses."""
    return str(dtype).replace("torch.", "")


def check_bool(what: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{what} takes True or False, got {value!r}")
    return value


def check_int(what: str, value: Any, *, at_least: int) -> int:
    """An int (not a bool) >= ``at_least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        kind = "a positive int (>= 1)" if at_least == 1 else f"an int >= {at_least}"
        raise ConfigError(f"{what} must be {kind}, got {value!r}")
    return value


def check_number(
    what: str,
    value: Any,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    allow_inf: bool = False,
) -> float:
    """A real number within the given bounds (``above``/``below`` exclusive, ``at_least``
    inclusive), finite unless ``allow_inf``. Returns it as a float."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok:
        value = float(value)
        ok = not math.isnan(value) and (allow_inf or math.isfinite(value))
        ok = ok and (above is None or value > above) and (at_least is None or value >= at_least)
        ok = ok and (below is None or value < below)
    if not ok:
        raise ConfigError(
            f"{what} must be {_describe(above, at_least, below, allow_inf)}, got {value!r}"
        )
    return value


def _describe(above, at_least, below, allow_inf) -> str:
    if above == 0 and below is None and at_least is None:
        text = "a positive number"
    elif above is not None and below is not None:
        return f"in ({_num(above)}, {_num(below)})"
    elif above is not None:
        text = f"greater than {_num(above)}"
    elif at_least is not None:
        text = f"a number >= {_num(at_least)}"
    else:
        text = "a number"
    return text + (" or float('inf')" if allow_inf else " (finite)")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def check_choice(what: str, value: Any, choices: Iterable[Any], hint: str = "") -> Any:
    choices = tuple(choices)
    if value not in choices:
        listed = ", ".join(str(c) for c in choices)
        raise ConfigError(f"unknown {what} {value!r}; choose one of {listed}{hint}")
    return value


def check_low_precision_dtype(what: str, dtype: Any) -> torch.dtype:
    if dtype not in LOW_PRECISION_DTYPES:
        raise ConfigError(
            f"{what}={dtype!r}: the low-precision dtype must be torch.float16 or torch.bfloat16"
        )
    return dtype


def check_opt_level(level: Any) -> str:
    return check_choice(
        "AMP opt level",
        level,
        OPT_LEVELS,
        " (O0 fp32, O1 precision lists, O2 everything but deny ops and pinned modules, "
        "O3 everything)",
    )
