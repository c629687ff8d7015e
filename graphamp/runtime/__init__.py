"""Every call of a Graph: find the compiled step that serves it, build one through the pipeline
when none does, and run it as a transaction.

``calls.call`` is the one function a call enters here; ``programs`` is the Graph's cache of
Programs and ``structure_key`` the in-memory key a call is matched by (the module tree, the
optimizers, the settings); ``ambient``, ``interrupts``, ``schedulers`` and ``overflows`` are what a
step does around the compiled program; ``graph_state`` is the Graph's own state dict.
"""
