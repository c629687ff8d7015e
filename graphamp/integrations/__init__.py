"""graphamp inside the loops users already have.

- ``function.py``: ``graphamp.training_step``, a decorator that turns a plain step function into
  a Graph (no subclass).
- ``transformers.py``: ``Trainer``, the transformers Trainer with its training steps run by
  graphamp (imports transformers when imported).
- ``lightning.py``: ``GraphampModule``, a LightningModule whose training step runs through
  graphamp under Lightning's Trainer (imports lightning when imported).

Only ``function.py`` is imported with graphamp; the other two are imported by the user, so
graphamp imports without transformers or lightning installed.
"""
