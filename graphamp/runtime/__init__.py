"""The runtime: compile the assembled step (stage 5), replay it (CUDA graphs), and run every call
of a Graph on the live state.

``compile_step`` hands the assembled graph to a torch.compile backend; ``Runner`` gathers the
user's tensors and graphamp's own state for every call of one compiled step; ``calls.call`` is
what a call of a Graph runs (the cache key, ambient modes, the step transaction with its
interrupts, schedulers and overflow reads); ``distributed`` coordinates the ranks of a
data-parallel graph when a step is built.
"""

from .compile import compile_step
from .cudagraph import CudaGraphStep
from .runner import Runner

__all__ = ["CudaGraphStep", "Runner", "compile_step"]
