"""The records the stages hand each other: data, each field with the invariant its stage keeps
(checked in ``__post_init__`` where cheap), and the small checks users' settings go through.

Every module here imports torch, the standard library, ``graphamp.errors`` and other records
only: never a stage, the Graph or the pipeline (``docs/architecture.md``). Code that works on
torch's machinery (FX graphs, graphamp's ops, fake tensors) is ``graphamp.torchkit``.
"""
