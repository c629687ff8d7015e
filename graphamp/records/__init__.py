"""The records the stages hand each other, and the vocabulary they share.

Every module here imports torch, the standard library, ``graphamp.errors`` and other records
only: never a stage, the Graph or the pipeline (``docs/architecture.md``).
"""
