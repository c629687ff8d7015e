"""Every Python block of the README and of docs/*.md runs as a reader pastes it, on the CPU
(``doc_snippets.py``: a page's blocks in order in one fresh process; aot_eager where a page does
not choose its backend). A page whose blocks start a process group runs under torchrun on 2
gloo processes (slow lane)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import doc_snippets
import pytest
from helpers import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tests", "doc_snippets.py")
PAGES = [
    os.path.relpath(p, ROOT)
    for p in [
        os.path.join(ROOT, "README.md"),
        *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))),
    ]
    if doc_snippets.blocks(p)
]


def _marks(page: str) -> list:
    return [pytest.mark.slow] if doc_snippets.needs_process_group(os.path.join(ROOT, page)) else []


@pytest.mark.parametrize("page", [pytest.param(p, marks=_marks(p)) for p in PAGES])
def test_every_block_of_the_page_runs_as_pasted(page):
    path = os.path.join(ROOT, page)
    if doc_snippets.needs_process_group(path):
        torchrun(RUNNER, path, timeout=600)
        return
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests")}
    done = subprocess.run(
        [sys.executable, RUNNER, path], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert f"page ran: {path}" in done.stdout


def test_the_pages_with_code_are_the_readme_integrations_and_distributed():
    """A new page's code blocks are picked up by the test above; this names today's."""
    assert PAGES == ["README.md", "docs/distributed.md", "docs/integrations.md"]
