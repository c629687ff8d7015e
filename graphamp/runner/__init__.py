"""A compiled step bound to the live state: the pipeline makes one ``Runner`` per Program, and
every call of that Program runs through it (gather the user's tensors and graphamp's own state,
refresh what changed, call the compiled step, replay it as a CUDA graph on CUDA)."""

from .cudagraph import CudaGraphStep
from .runner import Runner

__all__ = ["CudaGraphStep", "Runner"]
