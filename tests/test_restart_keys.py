"""What a restart no longer recomputes (backend/aot_key.py, backend/source_keys.py).

- AOTAutograd's cache key of a step loaded from the step cache is read from the note its first
  compile wrote, while the compile's context (inductor's settings, thread count, torch) is the
  same; any change of context hashes the step again. A damaged or planted note is ignored.
- torch's and triton's source hashes are kept while their files are unchanged.

Each test has its own step cache directory (conftest) and its own inductor cache directory.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import models
import pytest
import torch
import torch.nn as nn
from helpers import assert_bitwise, make_graph
from torch._inductor.utils import fresh_cache

from graphamp.backend import cache_directory, source_keys, step_cache
from graphamp.step import block_update

# the models here are tiny: outlined as a model whose blocks do enough work is by default
pytestmark = pytest.mark.usefixtures("outline_small_blocks")

REMEMBERED = "AOTAutograd's key remembered"


def _counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache_")}


def _run(caplog, configure=None, threads: int | None = None, gpt: bool = False):
    """A fresh seed MLP (``gpt``: a 3-block TinyGPT, whose blocks' updates are one kernel
    call each by default), AdamW and bf16 Graph on inductor, trained 2 steps: (whether the
    step was loaded, whether AOTAutograd's key was remembered, what AOTAutograd's cache did,
    losses and state, the Graph)."""
    torch.manual_seed(0)
    model = models.TinyGPT(layers=3) if gpt else models.seed_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    batches = (
        [(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))) for _ in range(2)]
        if gpt
        else models.batches(2, 16, 256, 10, seed=1)
    )
    g = make_graph(
        model,
        models.lm_loss if gpt else nn.CrossEntropyLoss(),
        opt,
        backend="inductor",
        amp=torch.bfloat16,
        configure=configure,
    )
    before = _counters()
    caplog.clear()
    previous = torch.get_num_threads()
    if threads is None and gpt:
        # One thread: inductor's CPU kernel for an embedding's backward adds rows with atomic
        # adds in a parallel loop, so with two threads two runs of one compiled program can
        # differ in the last bit of a row of wte.weight's gradient (CI's torch 2.15.0 leg, and
        # here under ATEN_CPU_CAPABILITY=avx2); the runs compared bitwise must add in one order.
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with caplog.at_level(logging.INFO, logger="graphamp"):
            losses = [g(x, y).detach().clone() for x, y in batches]
    finally:
        torch.set_num_threads(previous)
    after = _counters()
    cache = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    loaded = "assemble" not in g.compiled_steps[-1].timings
    return loaded, REMEMBERED in caplog.text, cache, (losses, model.state_dict()), g


def _notes() -> list[str]:
    return sorted(n for n in os.listdir(cache_directory.directory()) if n.endswith(".aot"))


@pytest.mark.inductor
def test_a_restart_reads_aot_autograds_key_from_the_note_and_trains_bitwise(caplog):
    with fresh_cache():
        cold = _run(caplog)
        assert cold[:2] == (False, False) and cold[2].get("autograd_cache_saved") == 1, cold[:3]
        assert len(_notes()) == 1
        warm = _run(caplog)
        assert warm[:2] == (True, True), warm[:3]
        assert warm[2] == {"autograd_cache_hit": 1}, warm[2]
        assert_bitwise(cold[3], warm[3])


@pytest.mark.inductor
def test_a_restart_compiles_from_the_note_and_loads_the_graph_only_when_read(caplog, tmp_path):
    """With the note's context, a restart hands inductor a stand-in of the step's inputs and
    the step's graph stays on disk (``noted_step.py``); it trains bitwise like the cold run,
    and ``compiled_steps`` loads the graph on the first read. With inductor's caches gone,
    the stand-in stops at its trace (nothing compiled or saved from it): the step is loaded and
    compiled, and the restart after that compiles from the note again, bitwise."""
    with fresh_cache():
        cold = _run(caplog)
        cold_code = cold[4].compiled_steps[-1].step_graph.code
        warm = _run(caplog)
        assert warm[:2] == (True, True) and warm[2] == {"autograd_cache_hit": 1}, warm[:3]
        assert "the step's graph not loaded" in caplog.text
        assert_bitwise(cold[3], warm[3])
        step = warm[4]._programs.last().step
        assert not step.in_memory
        assert warm[4].compiled_steps[-1].step_nodes == len(
            cold[4].compiled_steps[-1].step_graph.graph.nodes
        )
        assert not step.in_memory  # the node count is the note's
        assert warm[4].compiled_steps[-1].step_graph.code == cold_code
        assert step.in_memory
    with fresh_cache(dir=str(tmp_path)):  # the step cache and its notes stay
        missed = _run(caplog)
        assert missed[:2] == (True, True), missed[:3]
        assert "the step's graph not loaded" not in caplog.text
        assert missed[2].get("autograd_cache_saved") == 1, missed[2]
        assert missed[4]._programs.last().step.in_memory
        assert_bitwise(cold[3], missed[3])
        again = _run(caplog)
        assert "the step's graph not loaded" in caplog.text
        assert again[2] == {"autograd_cache_hit": 1}, again[2]
        assert_bitwise(cold[3], again[3])


@pytest.mark.slow
@pytest.mark.inductor
def test_a_restart_with_block_updates_makes_their_kernels_from_the_note(
    caplog, monkeypatch, tmp_path
):
    """The blocks' update kernels are made from the specs the note keeps, so a restart of a
    step with block updates (the CPU's default for 3 equal blocks) compiles from the note too,
    without loading the step's graph; each kernel has a note of its own, so the restart does
    not trace the kernel's math either. It trains bitwise like the cold run. A cold compile
    with the kernels compiled beside the step (``pipeline/side_compile.py``, on by default)
    makes them from the child's notes, and trains bitwise like the cold run too."""
    monkeypatch.setenv("GRAPHAMP_SIDE_COMPILE", "0")  # the traces counted here are this process's
    # as a new process has them: a test run before this one in the process may have made
    # the same kernel (same spec), and then this cold run would make none
    monkeypatch.setattr(block_update, "_KERNELS", {})
    traced = []
    trace = block_update.trace_functional
    monkeypatch.setattr(
        block_update, "trace_functional", lambda *a, **k: traced.append(1) or trace(*a, **k)
    )
    with fresh_cache():
        cold = _run(caplog, gpt=True)
        assert "1 block update kernel" in caplog.text and traced == [1]
        assert len(_notes()) == 2  # the step's and the kernel's
        monkeypatch.setattr(block_update, "_KERNELS", {})  # as a new process has them
        warm = _run(caplog, gpt=True)
        assert warm[:2] == (True, True), warm[:3]
        assert "the step's graph not loaded" in caplog.text, caplog.text
        assert "1 block update kernel" in caplog.text and traced == [1]
        assert warm[2] == {"autograd_cache_hit": 2}, warm[2]
        assert not warm[4]._programs.last().step.in_memory
        assert_bitwise(cold[3], warm[3])
    monkeypatch.setattr(block_update, "_KERNELS", {})
    with fresh_cache(dir=str(tmp_path)):  # inductor's caches gone; the notes stay
        missed = _run(caplog, gpt=True)
        assert traced == [1, 1] and missed[2].get("autograd_cache_saved") == 2, missed[2]
        assert_bitwise(cold[3], missed[3])
    monkeypatch.setenv("GRAPHAMP_SIDE_COMPILE", "1")
    monkeypatch.setenv("GRAPHAMP_CACHE_DIR", str(tmp_path / "another"))
    monkeypatch.setattr(block_update, "_KERNELS", {})
    with fresh_cache():  # cold: the child compiles the kernel and notes it, this process reads
        beside = _run(caplog, gpt=True)
        assert "1 block update kernel" in caplog.text and traced == [1, 1]
        assert "(compiled beside the step)" in caplog.text, caplog.text
        assert beside[2].get("autograd_cache_hit") == 1, beside[2]  # the kernel, from the note
        assert len(_notes()) == 2
        assert_bitwise(cold[3], beside[3])


@pytest.mark.slow  # four inductor compiles (25 s); the default lane keeps the restart above
@pytest.mark.inductor
def test_a_changed_context_or_a_damaged_note_hashes_the_step_again(caplog):
    """Another thread count or another inductor setting is another context: the note is not
    used, and the step is hashed (a miss, where the setting changes what inductor makes); the
    note then holds the new context. A note that is not authentic is ignored with a warning."""
    with fresh_cache():
        base = _run(caplog)
        assert not base[1]

        threads = _run(
            caplog, threads=torch.get_num_threads() + 1
        )  # differs on a 1-thread machine too
        assert threads[0] and not threads[1], threads[:3]

        options = _run(
            caplog, configure=lambda g: g.config.set_inductor_options(**{"cpp.simdlen": 1})
        )
        assert options[0] and not options[1], options[:3]
        assert "autograd_cache_miss" in options[2], options[2]
        again = _run(
            caplog, configure=lambda g: g.config.set_inductor_options(**{"cpp.simdlen": 1})
        )
        assert again[1] and again[2] == {"autograd_cache_hit": 1}, again[:3]
        assert_bitwise(options[3], again[3])

        (note,) = _notes()
        path = os.path.join(cache_directory.directory(), note)
        with open(path, "rb") as f:
            data = f.read()
        planted = data.replace(b'"key": "', b'"key": "x')  # another key, the old HMAC
        with open(path, "wb") as f:
            f.write(planted)
        damaged = _run(
            caplog, configure=lambda g: g.config.set_inductor_options(**{"cpp.simdlen": 1})
        )
        assert not damaged[1] and damaged[2] == {"autograd_cache_hit": 1}, damaged[:3]
        assert "not authenticated" in caplog.text
        assert_bitwise(options[3], damaged[3])


def test_the_files_fingerprint_changes_with_any_file(tmp_path):
    import hashlib

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "notes.txt").write_text("not read by torch_key\n")

    def fingerprint() -> str:
        h = hashlib.sha256()
        source_keys._walk(str(tmp_path), h)
        return h.hexdigest()

    first = fingerprint()
    assert fingerprint() == first
    (tmp_path / "pkg" / "notes.txt").write_text("changed\n")
    assert fingerprint() == first  # not a file the hashes read
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")  # same size, new time
    os.utime(tmp_path / "pkg" / "a.py", ns=(1, 1))
    second = fingerprint()
    assert second != first
    (tmp_path / "pkg" / "b.so").write_bytes(b"")
    assert fingerprint() != second


_CHILD = textwrap.dedent(
    """
    import json, sys
    from graphamp.backend import source_keys
    from torch._inductor.codecache import torch_key
    fingerprint = source_keys.preset("child")
    print(json.dumps({"fingerprint": fingerprint, "torch_key": torch_key().hex()}))
    """
)


def _child(env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_kept_source_hashes_are_given_to_torch_only_while_the_files_are_unchanged(
    tmp_path, monkeypatch
):
    """A kept note whose fingerprint is the files' gives torch its values (a planted value
    proves it was not computed); with another fingerprint torch computes its own."""
    if source_keys._torch_hashes() is None:
        pytest.skip("this torch's source hashes cannot be set")
    monkeypatch.setenv("GRAPHAMP_CACHE_DIR", str(tmp_path))
    env = dict(os.environ)
    real = _child(env)
    fingerprint = real["fingerprint"]
    assert fingerprint is not None

    def keep(fp: str) -> None:
        values = {"torch": ["bytes", "ab" * 32], "triton": ["none", None]}
        assert step_cache.save_note(
            "test", *source_keys._note(), {"fingerprint": fp, "values": values}
        )

    keep(fingerprint)
    assert _child(env)["torch_key"] == "ab" * 32
    keep("0" * 64)  # files changed since
    assert _child(env)["torch_key"] == real["torch_key"]


def test_another_graphamps_note_of_source_hashes_is_not_read_nor_warned_about(
    tmp_path, monkeypatch, caplog
):
    """Another graphamp (an upgrade, an edited checkout) authenticates its files under its own
    source: its note of torch's source hashes is its own, and this graphamp neither reads it
    nor takes it for a damaged file (a warning on every run after an upgrade, until a compile
    replaced it; at every run where no compile did)."""
    monkeypatch.setenv("GRAPHAMP_CACHE_DIR", str(tmp_path))
    note = {"fingerprint": "f" * 64, "values": {"torch": ["none", None]}}
    with monkeypatch.context() as other:
        for module in (source_keys, cache_directory):
            other.setattr(module, "graphamp_source", lambda: "another graphamp's source")
        assert step_cache.save_note("test", *source_keys._note(), note)
        assert source_keys._kept("test") == note  # that graphamp reads its own note
    with caplog.at_level(logging.INFO, logger="graphamp"):
        assert source_keys._kept("test") is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert step_cache.save_note("test", *source_keys._note(), note)
    assert source_keys._kept("test") == note
