"""Stage 5 and after: compile the step, replay it (CUDA graphs), run it on the live state.

``compile_step`` hands the assembled graph to a torch.compile backend; ``Runner`` gathers the
user's tensors and graphamp's own state for every call; ``distributed`` coordinates the ranks
of a data-parallel graph when a step is built.
"""

from .compile import compile_step
from .cudagraph import CudaGraphStep
from .runner import Runner

__all__ = ["CudaGraphStep", "Runner", "compile_step"]
