"""The block kernels compiled in a child process beside the step (``pipeline/side_compile.py``).

The whole path (a cold compile whose kernel the child makes, trained bitwise like one made in
this process) is in ``test_restart_keys.py``; here, what happens when the child cannot help:
it fails, it takes too long, or it does not apply. None of these compiles anything.
"""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

from graphamp.pipeline import side_compile
from graphamp.step import block_update

# the models here are tiny: outlined as a model whose blocks do enough work is by default
pytestmark = pytest.mark.usefixtures("outline_small_blocks")


def _spec(device: str = "cpu") -> str:
    """The spec of an SGD update of a block of two small parameters."""
    flat = [torch.empty(4, device="meta"), torch.empty(3, device="meta")] * 2
    spec = block_update.spec_text("sgd", {}, [], [], 2, False, flat)
    return spec.replace('"meta"', f'"{device}"')


def _started(specs: list[str]):
    """A child spawned and asked for ``specs``; None where it was not, or told to stop."""
    beside = side_compile.SideCompile.spawn("G")
    if beside is None or not beside.request("G", specs):
        return None
    return beside


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv("GRAPHAMP_SIDE_COMPILE", "1")
    monkeypatch.setattr(side_compile, "_cores", lambda: 2)


def test_a_failed_child_is_reported_and_leaves_the_kernels_to_this_process(on, monkeypatch, caplog):
    monkeypatch.setattr(
        side_compile, "_CHILD", "import sys; sys.stderr.write('no kernel here'); sys.exit(3)"
    )
    beside = _started([_spec()])
    assert beside is not None
    with caplog.at_level(logging.DEBUG, logger="graphamp"):
        assert not beside.finished("G")
    assert "the side compile failed (exit code 3)" in caplog.text
    assert "no kernel here" in caplog.text


def test_a_child_that_takes_too_long_is_stopped(on, monkeypatch, caplog):
    monkeypatch.setattr(side_compile, "_CHILD", "import time; time.sleep(60)")
    monkeypatch.setattr(side_compile, "WAIT_S", 0.5)
    beside = _started([_spec()])
    assert beside is not None
    with caplog.at_level(logging.DEBUG, logger="graphamp"):
        assert not beside.finished("G")
    assert beside.seconds() < 30  # stopped, not waited for
    assert "stopped" in caplog.text


def test_the_child_gets_the_request_and_this_processs_cache_directories(on, monkeypatch, tmp_path):
    """The child reads the kernels' specs from its stdin, and compiles into the directories
    this process resolved (its own environment may say otherwise)."""
    out = tmp_path / "seen.txt"
    monkeypatch.setattr(
        side_compile,
        "_CHILD",
        "import os, pickle, sys; r = pickle.loads(sys.stdin.buffer.read()); "
        f"open({str(out)!r}, 'w').write('\\n'.join([r['graph'], r['specs'][0], "
        "os.environ['TORCHINDUCTOR_CACHE_DIR'], os.environ['GRAPHAMP_CACHE_DIR']]))",
    )
    monkeypatch.setenv("GRAPHAMP_CACHE_DIR", str(tmp_path / "steps"))
    beside = _started([_spec()])
    assert beside is not None and beside.finished("G")
    assert not beside.request("G", [_spec()])  # asked once: a second try compiles here
    graph, spec, inductor_dir, graphamp_dir = out.read_text().splitlines()
    assert (graph, spec) == ("G", _spec())
    assert inductor_dir == side_compile.inductor_cache_directory()
    assert graphamp_dir == str(tmp_path / "steps")


def test_nothing_is_compiled_beside_where_the_side_compile_does_not_apply(on, monkeypatch):
    """No child where it is turned off or this process has one core; a child is told to stop
    where there is nothing for it: no kernels, a CUDA block's, or one made here already."""
    assert _started([]) is None  # no kernels
    assert _started([_spec(device="cuda")]) is None  # a CUDA block's kernel
    made = _spec()
    key = (made, tuple(t.stride() for t in block_update.block_example(made)))
    monkeypatch.setitem(block_update._KERNELS, key, lambda *a: None)
    beside = side_compile.SideCompile.spawn("G")
    assert beside is not None and not beside.request("G", [made])  # made here already
    assert beside._proc.poll() is not None  # stopped
    monkeypatch.setenv("GRAPHAMP_SIDE_COMPILE", "0")
    assert side_compile.SideCompile.spawn("G") is None  # turned off
    monkeypatch.setenv("GRAPHAMP_SIDE_COMPILE", "1")
    monkeypatch.setattr(side_compile, "_cores", lambda: 1)
    assert side_compile.SideCompile.spawn("G") is None  # one core: it would take turns


def _childs_context(monkeypatch, tmp_path, parent: dict) -> dict:
    """The compile context of a child given ``parent``'s."""
    out = tmp_path / "state.pickle"
    monkeypatch.setattr(
        side_compile,
        "_CHILD",
        "import pickle, sys; from graphamp.pipeline import side_compile as s; "
        "s._take_context(pickle.loads(sys.stdin.buffer.read())['context']); "
        f"open({str(out)!r}, 'wb').write(pickle.dumps(s.context_state()))",
    )
    monkeypatch.setattr(side_compile, "context_state", lambda: parent)
    beside = _started([_spec()])
    assert beside is not None and beside.finished("G")
    child = pickle.loads(out.read_bytes())
    inductor = pickle.loads(child.pop("inductor"))
    assert inductor.pop("compile_threads") == 1  # the child's one exception
    expected = pickle.loads(parent["inductor"])
    expected.pop("compile_threads")
    assert inductor == expected
    return {**child, "inductor": inductor}


@pytest.mark.parametrize("changed", [False, True])
def test_the_child_compiles_in_this_processs_context(on, monkeypatch, tmp_path, changed):
    """The settings AOTAutograd's and inductor's keys read (inductor's and functorch's config,
    the thread count, the default dtype, matmul precision, deterministic algorithms) go to the
    child as this process has them, changed in the process or untouched (an untouched cuda
    fp32 precision is "none", which setting the float32 matmul precision would make "ieee"):
    a kernel compiled in another context would not be used."""
    import torch._inductor.config as inductor_config

    # pytest 9.2's monkeypatch undoes a setting of a config module, or of torch's cuBLAS module,
    # by deleting it (it does not see the value as an attribute of its own): inductor's config
    # is patched with its own patch, and the matmul settings are put back by hand
    matmul = torch.backends.cuda.matmul
    before = (
        torch.get_float32_matmul_precision(),
        matmul.fp32_precision,
        matmul.allow_bf16_reduced_precision_reduction,
    )
    try:
        with inductor_config.patch(
            max_fusion_size=17 if changed else inductor_config.max_fusion_size
        ):
            if changed:
                matmul.allow_bf16_reduced_precision_reduction = False
                torch.set_float32_matmul_precision("medium")
            parent = side_compile.context_state()
    finally:
        torch.set_float32_matmul_precision(before[0])
        matmul.fp32_precision = before[1]
        matmul.allow_bf16_reduced_precision_reduction = before[2]
    child = _childs_context(monkeypatch, tmp_path, parent)
    assert {k: v for k, v in child.items() if k != "inductor"} == {
        k: v for k, v in parent.items() if k != "inductor"
    }
    assert (child["inductor"]["max_fusion_size"] == 17) == changed
    assert (child["float32_matmul_precision"] == "medium") == changed
    assert (child["cuda_matmul"][2] is False) == changed
