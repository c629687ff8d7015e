"""Build time, after assembly: compile the step (stage 5) and keep it across restarts.

``compile.compile_step`` hands the assembled graph to a torch.compile backend;
``inductor_cache`` rebuilds around damaged entries of inductor's own cache; ``step_cache`` keeps
the assembled step on disk under ``step_key`` (its traced values compact: ``step_values``; in a
directory of the user's own whose files are authenticated and pruned: ``cache_directory``) (the disk key: a digest of everything assembly
read; the in-memory key a call is matched by is ``runtime/structure_key.py``); ``aot_key`` and
``source_keys`` spare a restart the hashing inductor's cache lookups start with (AOTAutograd's
key of the cached step, torch's source hashes), each kept beside the step cache's entries, and
``noted_step`` compiles a restart's static step from that note without unpickling its graph;
``distributed`` makes every rank build the same step; ``progress`` is what a long build says.
Nothing here runs on a steady call.
"""

from .compile import compile_step

__all__ = ["compile_step"]
