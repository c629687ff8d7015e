"""Compiling a CPU step makes glibc's malloc keep freed memory (``config.set_keep_cpu_memory``,
``runner/host_memory.py``): buffers a step frees are reused by the next one instead of being
given back to the OS and faulted in again. Each case runs in a fresh process, since the setting
is process-wide and cannot be undone."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="glibc's malloc only",
)

# Four 8 MiB buffers allocated and freed: the heap's free top (32 MiB) is past glibc's trim
# threshold, so without the setting most of it goes back to the OS each round (about 8,000
# page faults a round here) and comes back as fresh pages.
SCRIPT = textwrap.dedent(
    """
    import json, logging, resource, sys, torch, torch.nn as nn
    import graphamp

    def round_faults():
        for _ in range(3):
            bufs = [torch.ones(2 << 20) for _ in range(4)]
            del bufs
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        bufs = [torch.ones(2 << 20) for _ in range(4)]
        del bufs
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("graphamp").addHandler(handler)
    logging.getLogger("graphamp").setLevel(logging.INFO)

    class Step(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = nn.Linear(4, 4)
            self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))
            self.config.set_backend("eager")
            self.config.set_step_cache(False)
            self.config.set_keep_cpu_memory(sys.argv[1] == "on")

        def build(self, x):
            loss = self.model(x).square().mean()
            loss.backward()
            return loss

    step = Step()
    step(torch.randn(2, 4))
    step(torch.randn(2, 4))
    from graphamp.runner import host_memory
    print(json.dumps({
        "kept": host_memory._kept,
        "faults": round_faults(),
        "lines": [m for m in records if "keeps freed memory" in m],
    }))
    """
)


def _run(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cpu_step_keeps_freed_memory_in_the_process():
    got = _run("on")
    assert got["kept"] is True
    assert got["faults"] < 200, got  # reused from the heap, not faulted in again
    assert len(got["lines"]) == 1 and "set_keep_cpu_memory(False)" in got["lines"][0]


def test_keep_cpu_memory_off_leaves_malloc_alone():
    got = _run("off")
    assert got["kept"] is None and got["lines"] == []


def test_keep_cpu_memory_rejects_a_non_bool():
    import graphamp

    with pytest.raises(Exception, match="set_keep_cpu_memory"):
        graphamp.Graph().config.set_keep_cpu_memory("yes")  # type: ignore[arg-type]
