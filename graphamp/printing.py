"""print(graph): placeholder until the inspection issue."""
from __future__ import annotations


def graph_repr(graph) -> str:
    return f"{type(graph).__name__}()"
