"""Build time, after assembly: compile the step (stage 5) and keep it across restarts.

``compile.compile_step`` hands the assembled graph to a torch.compile backend;
``inductor_cache`` rebuilds around damaged entries of inductor's own cache; ``step_cache`` keeps
the assembled step on disk under ``step_key`` (the disk key: a digest of everything assembly
read; the in-memory key a call is matched by is ``runtime/structure_key.py``), its traced
values in ``step_values``'s compact form, in ``cache_directory`` (the user's own directory,
its files authenticated and pruned); ``aot_key`` and ``source_keys`` spare a restart the
hashing inductor's cache lookups start with (AOTAutograd's key of the cached step, torch's
source hashes), each kept beside the step cache's entries, and ``noted_step`` compiles a
restart's static step from that note without unpickling its graph; ``distributed`` makes every
rank build the same step; ``progress`` is what a long build says.
Nothing here runs on a steady call.
"""

from .compile import compile_step

__all__ = ["compile_step"]
