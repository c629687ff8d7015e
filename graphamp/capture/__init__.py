"""Stage 1, capture: build() traced once into a functional aten-level forward graph.

``capture_forward`` makes the CapturedForward record; ``autocast_forward`` runs the same build()
under torch.autocast and measures its decisions (the oracle the precision report compares to).
"""

from .oracle import autocast_forward
from .root import (
    BuildRoot,
    check_devices,
    check_module_paths,
    checkpointed_paths,
    fake_copy,
    pinned_paths,
    refuse_sparse_tensors,
)
from .trace import capture_forward

__all__ = [
    "BuildRoot",
    "autocast_forward",
    "capture_forward",
    "check_devices",
    "refuse_sparse_tensors",
    "fake_copy",
    "check_module_paths",
    "pinned_paths",
    "checkpointed_paths",
]
