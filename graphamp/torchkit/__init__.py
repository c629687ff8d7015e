"""graphamp's code over torch's own machinery, shared by every stage: FX helpers and node
metadata (``fxutil``), graphamp's torch ops (``ops``, and the numerics modules it registers), fake
tensors and symbolic sizes (``shapes``), ops torch marks effectful (``effects``), what the ranks
of a process group tell each other through its store (``rank_store``) and every branch on the
torch release (``compat``).

Importing ``graphamp.torchkit.ops`` registers the ``graphamp::`` torch library: the package's one
import-time registration (``graphamp/__init__.py`` imports it first, so every process that
imports graphamp has the ops before any graph is traced or a step is unpickled). Everything
graphamp holds for the whole process (patches of torch, hooks, caches) is declared in
``process_state``.
"""
