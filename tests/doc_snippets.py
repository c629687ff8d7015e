"""The Python blocks of the README and of docs/*.md, as a reader pastes them.

A page's blocks run in order in one namespace, as a reader pastes one after the other into one
session (a block may continue the one above it: the SAM example reuses the Use block's model).
``run_page(path)`` runs them in this process; where a block does not choose a backend, graphamp's
default is made ``aot_eager`` for the run (inductor's CPU first call is 10-15 s a block). The
test runs each page in a fresh process (``python tests/doc_snippets.py PAGE``); a page whose
blocks start a process group runs under ``torchrun`` on 2 gloo processes.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(path: str) -> list[str]:
    with open(path) as f:
        return _BLOCK.findall(f.read())


def needs_process_group(path: str) -> bool:
    return any("init_process_group" in b for b in blocks(path))


def run_page(path: str) -> None:
    import graphamp.config as config

    page = blocks(path)
    if not any("set_backend" in b for b in page):
        _default_backend(config, "aot_eager")
    namespace = {"__name__": "__main__"}
    with tempfile.TemporaryDirectory() as work:
        os.chdir(work)  # dumps and checkpoints a block writes land here
        for i, block in enumerate(page):
            code = compile(block, f"{os.path.basename(path)}, block {i + 1}", "exec")
            exec(code, namespace)  # noqa: S102 - the project's own documentation


def _default_backend(config, backend: str) -> None:
    original = config.GraphConfig.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.set_backend(backend)

    config.GraphConfig.__init__ = __init__


if __name__ == "__main__":
    run_page(os.path.abspath(sys.argv[1]))
    print("page ran:", sys.argv[1])
