"""The command line: ``python -m graphamp demo``, ``python -m graphamp plot`` (``commands.main``)."""

from .commands import main

__all__ = ["main"]
