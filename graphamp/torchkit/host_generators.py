"""The process's random generators, left as they were by work the user did not ask for.

graphamp runs some of the user's code on copies before training: an optimizer's ``step()``
once on a copy to see whether it can be traced (``step/trial_step.py``), and once per parameter
to learn its first state (``step/traced_optimizer.py``). Code that draws (PSGD's Kron and its
``torch.randn_like``, Gravity's random first state, Magma's masks, ``np.random`` in a step)
would advance the generators the user seeded, and every draw of the real run after it would
differ from eager's. ``kept_host_generators`` puts back torch's CPU generator, every CUDA
generator that is initialised, Python's ``random`` and NumPy's global generator.
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import torch

try:
    import numpy as np
except ImportError:  # numpy is a base dependency; keep working without it anyway
    np = None  # type: ignore[assignment]


@contextlib.contextmanager
def kept_host_generators() -> Iterator[None]:
    """Run the body; then the generators hold the states they held before it, on every path."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    python = random.getstate()
    numpy = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(python)
        if numpy is not None:
            np.random.set_state(numpy)
