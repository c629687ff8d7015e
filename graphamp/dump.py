"""g.dump(path): placeholder until the inspection issue."""
from __future__ import annotations

import os


def dump_program(graph, program, path: str) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "forward.py"), "w") as f:
        f.write(program.forward.code)
    return os.path.abspath(path)
