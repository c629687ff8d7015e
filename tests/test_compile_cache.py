"""A restart on the same inductor cache directory reuses the compiled step.

inductor's FX-graph cache and AOTAutograd's cache bypass themselves unless the backend runs in a
TracingContext whose fake mode has a ShapeEnv; compile_step gives it one, with the step's own
static fake inputs (real inputs would be fakified again with a symbol per dimension, which broke
AOTAutograd's tensorify_python_scalars).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile

import models
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from helpers import assert_bitwise, make_graph
from torch._guards import TracingContext
from torch._inductor.codecache import PyCodeCache
from torch._subclasses.fake_tensor import FakeTensor

from graphamp.backend.compile import compile_step
from graphamp.backend.inductor_cache import rebuild_if_cache_unreadable
from graphamp.torchkit.fxutil import copy_graph_module, trace_functional

# the models here are tiny: outlined as a model whose blocks do enough work is by default
pytestmark = pytest.mark.usefixtures("outline_small_blocks")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _toy_step_graph():
    """A functional training step of a BatchNorm MLP, traced as assembly traces the step."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    names = [k for k, _ in model.named_parameters()] + [k for k, _ in model.named_buffers()]

    def step(*flat):
        ps = [p.detach().requires_grad_(True) for p in flat[: len(params)]]
        state = dict(zip(names, [*ps, *flat[len(params) : -2]]))
        x, y = flat[-2:]
        out = torch.func.functional_call(model, state, (x,))
        loss = nn.functional.cross_entropy(out, y)
        for p, g in zip(flat, torch.autograd.grad(loss, ps)):
            p.copy_(p - 0.1 * g)
        return (loss.detach(),)

    example = [*params, *buffers, torch.randn(4, 8), torch.randint(0, 3, (4,))]
    return trace_functional(step, example, propagate_input_mutations=True), example


def test_backend_gets_a_shape_env_and_static_fake_inputs():
    gm, example = _toy_step_graph()
    seen = {}

    def backend(graph, inputs):
        context = TracingContext.try_get()
        seen["shape_env"] = context is not None and context.fake_mode.shape_env is not None
        seen["fakes"] = all(isinstance(t, FakeTensor) for t in inputs)
        seen["static"] = all(isinstance(s, int) for t in inputs for s in t.shape)
        seen["same_mode"] = all(t.fake_mode is context.fake_mode for t in inputs)
        return graph

    compile_step(gm, example, backend)
    assert seen == {"shape_env": True, "fakes": True, "static": True, "same_mode": True}


def test_views_become_reshapes_in_outlined_subgraphs_too():
    """The backend traces every subgraph again with its own layouts: a ``view`` assembly
    recorded inside an outlined block fails there as in the top graph (seen on transformers'
    GPT-2 with an attention mask), so both become ``reshape``."""
    from graphamp.backend.compile import views_as_reshapes

    model = models.TinyGPT()
    g = make_graph(model, models.lm_loss, torch.optim.AdamW(model.parameters()), backend="eager")
    g(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    step = copy_graph_module(g.compiled_steps[-1].step_graph)
    subgraphs = [m for m in step.modules() if isinstance(m, fx.GraphModule) and m is not step]
    assert subgraphs  # the blocks were outlined

    def views(m):
        return sum(n.target is torch.ops.aten.view.default for n in m.graph.nodes)

    assert sum(map(views, subgraphs)) > 0
    views_as_reshapes(step)
    assert views(step) == 0 and sum(map(views, subgraphs)) == 0


def test_a_step_from_the_step_cache_does_not_start_inductors_compile_pool(monkeypatch):
    """inductor's backend starts its pool of compile processes at every call; a step served
    from the caches compiles nothing, and on two cores the pool's start made the first
    seconds' steps 3x slower. Cold, the pool is started as before."""
    import torch._inductor.async_compile as async_compile
    import torch._inductor.compile_fx as compile_fx

    gm, example = _toy_step_graph()
    seen = []
    monkeypatch.setattr(
        async_compile, "maybe_warm_pool", lambda: seen.append(os.environ.get("TORCH_WARM_POOL"))
    )
    monkeypatch.setattr(compile_fx, "compile_fx", lambda graph, inputs, **kw: graph)
    compile_step(gm, example, "inductor", cached=True)
    compile_step(gm, example, "inductor")
    assert seen == ["0", os.environ.get("TORCH_WARM_POOL")]
    assert os.environ.get("TORCH_WARM_POOL") != "0"  # put back


def test_aot_eager_compiles_in_the_tracing_context_and_matches_the_graph():
    """AOTAutograd runs tensorify_python_scalars once a ShapeEnv is present: with the step's
    static fakes there is no unbound size symbol for it to trip on."""
    gm, example = _toy_step_graph()
    compiled = compile_step(gm, example, "aot_eager")
    ours, ref = [t.clone() for t in example], [t.clone() for t in example]
    loss = compiled(*ours)[0]
    assert torch.equal(loss, gm(*ref)[0])
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def _worker(cases: str, cache_dir, out) -> subprocess.Popen:
    # graphamp's step cache follows inductor's directory, as it does for users. One thread:
    # inductor's CPU kernel for an embedding's backward adds rows with atomic adds in a parallel
    # loop, so with two threads two runs of one compiled program can differ in the last bit of
    # a gradient row (seen in CI: one element of wte.weight, 2e-9); the cold and warm runs
    # compared bitwise below must run the same arithmetic in the same order.
    env = {
        **{k: v for k, v in os.environ.items() if k != "GRAPHAMP_CACHE_DIR"},
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "cache_worker.py"), cases, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _results(worker: subprocess.Popen, out) -> tuple[dict, str]:
    """Each case's results, and the worker's stderr."""
    _, stderr = worker.communicate(timeout=900)
    assert worker.returncode == 0, stderr[-3000:]
    return torch.load(out, weights_only=True)["cases"], stderr


def _run_worker(cases: str, cache_dir, out) -> dict:
    return _results(_worker(cases, cache_dir, out), out)[0]


def _assert_same_run(a: dict, b: dict) -> None:
    assert_bitwise((a["losses"], a["state"]), (b["losses"], b["state"]))


@pytest.mark.inductor
@pytest.mark.parametrize(
    "case",
    [
        # the slow lane (25-33 s each); the default lane's restarts are test_restart_keys.py's
        pytest.param("fp16_scaler_adamw", marks=pytest.mark.slow),
        pytest.param("fp16_scaler_adamw_inlined", marks=pytest.mark.slow),
        pytest.param("fp16_scaler_adamw_fused", marks=pytest.mark.slow),
        pytest.param("masked_bf16_sgd", marks=pytest.mark.slow),
    ],
)
def test_restart_hits_inductor_and_aot_autograd_caches(case, tmp_path):
    cache_dir = tmp_path / "inductor-cache"
    cold = _run_worker(case, cache_dir, tmp_path / "cold.pt")[case]
    warm = _run_worker(case, cache_dir, tmp_path / "warm.pt")[case]
    assert cold["cache"].get("fxgraph_cache_miss") == 1, cold["cache"]
    assert cold["cache"].get("autograd_cache_saved") == 1, cold["cache"]
    assert warm["cache"].get("fxgraph_cache_hit") == 1, warm["cache"]
    assert warm["cache"].get("autograd_cache_hit") == 1, warm["cache"]
    assert not any("bypass" in k for k in {**cold["cache"], **warm["cache"]})
    assert cold["programs"] == warm["programs"] == 1
    assert not cold["loaded"] and warm["loaded"]  # graphamp's step cache served the restart
    # the program loaded from the cache computes what the freshly compiled one did, bitwise
    _assert_same_run(cold, warm)


@pytest.mark.slow
@pytest.mark.inductor
def test_dynamic_and_checkpointed_steps_restart_from_every_cache_in_a_fresh_process(tmp_path):
    """A step with the sequence length symbolic (after a static one) and a step with
    recomputed blocks, each restarted in a fresh process: every program is loaded from the
    step cache, takes AOTAutograd's key from its note, hits both of inductor's caches, and
    trains bitwise as the cold run."""
    cases = "dynamic_tinygpt,checkpointed_tinygpt"
    cold = _run_worker(cases, tmp_path / "cache", tmp_path / "cold.pt")
    warm = _run_worker(cases, tmp_path / "cache", tmp_path / "warm.pt")
    for name, programs in (("dynamic_tinygpt", 2), ("checkpointed_tinygpt", 1)):
        c, w = cold[name], warm[name]
        assert c["programs"] == w["programs"] == programs, name
        assert not c["loaded"] and w["all_loaded"], name
        assert c["remembered"] == 0 and w["remembered"] == programs, (name, w["remembered"])
        assert w["cache"].get("autograd_cache_hit") == programs, (name, w["cache"])
        assert "autograd_cache_miss" not in w["cache"], (name, w["cache"])
        _assert_same_run(c, w)


@pytest.mark.slow
def test_a_restart_of_real_models_loads_the_step_from_the_step_cache(tmp_path):
    """transformers' GPT-2 (labels, dropout drawing from torch's generator inside the step) and
    torchvision's ResNet-18 (BatchNorm buffers written by the step), each restarted in a fresh
    process: the second process loads the assembled, outlined step and trains bitwise as the
    first."""
    cases = "hf_gpt2,resnet18"
    cold = _run_worker(cases, tmp_path / "cache", tmp_path / "cold.pt")
    warm = _run_worker(cases, tmp_path / "cache", tmp_path / "warm.pt")
    for name in cases.split(","):
        assert not cold[name]["loaded"] and warm[name]["loaded"], name
        _assert_same_run(cold[name], warm[name])


CHANGED = ("wider", "gelu", "fp16", "pinned", "other_torch")


@pytest.mark.slow
@pytest.mark.inductor
def test_a_changed_model_config_pin_or_torch_never_hits_a_stale_entry(tmp_path):
    """After the base step is cached, each change (a layer size, an activation, the AMP dtype,
    an fp32 pin, another torch build) misses inductor's caches and computes, bitwise, what the
    same step computes in a fresh process on an empty cache directory."""
    shared = tmp_path / "shared"
    base = _run_worker("base", shared, tmp_path / "base.pt")["base"]
    changed = _run_worker(",".join(CHANGED), shared, tmp_path / "changed.pt")
    fresh = _run_worker(",".join(CHANGED), tmp_path / "empty", tmp_path / "fresh.pt")
    for name in CHANGED:
        cache = changed[name]["cache"]
        assert cache.get("fxgraph_cache_miss") == 1, (name, cache)
        assert "fxgraph_cache_hit" not in cache and "autograd_cache_hit" not in cache, (name, cache)
        assert not changed[name]["loaded"], name
        _assert_same_run(changed[name], fresh[name])
        # a stale hit would have been visible: every changed model or config computes other
        # numbers than the base; the other torch build compiles the base's step again
        differs = not torch.equal(changed[name]["losses"][-1], base["losses"][-1])
        assert differs == (name != "other_torch"), name


def _damage(cache_dir, how: str) -> int:
    """Scribble over (half of each file, then garbage) or empty every file of the cache."""
    damaged = 0
    for root, _, files in os.walk(cache_dir):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                data = f.read()
            with open(path, "wb") as f:
                f.write(
                    data[: len(data) // 2] + b"\x00damaged\xff" * 4 if how == "scribbled" else b""
                )
            damaged += 1
    return damaged


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("how", ["scribbled", "emptied"])
def test_a_damaged_cache_is_compiled_around_with_a_warning(how, tmp_path):
    cache_dir = tmp_path / "cache"
    cold = _run_worker("base", cache_dir, tmp_path / "cold.pt")["base"]
    assert _damage(cache_dir, how) > 0
    warm, stderr = _results(_worker("base", cache_dir, tmp_path / "warm.pt"), tmp_path / "warm.pt")
    assert "compiling it again in a fresh directory" in stderr, stderr[-3000:]
    assert "step cache: ignoring" in stderr, stderr[-3000:]  # graphamp's entry was damaged too
    assert str(cache_dir) in stderr
    _assert_same_run(cold, warm["base"])


@pytest.mark.slow
@pytest.mark.inductor
def test_two_processes_writing_one_cache_directory_at_once(tmp_path):
    cache_dir = tmp_path / "cache"
    outs = [tmp_path / "one.pt", tmp_path / "two.pt"]
    workers = [_worker("base,gelu", cache_dir, out) for out in outs]
    one, two = (_results(w, out)[0] for w, out in zip(workers, outs))
    for name in ("base", "gelu"):
        _assert_same_run(one[name], two[name])
    # and what they left behind serves a third process, bitwise
    third = _run_worker("base,gelu", cache_dir, tmp_path / "three.pt")
    for name in ("base", "gelu"):
        assert third[name]["cache"].get("fxgraph_cache_hit") == 1, third[name]["cache"]
        assert third[name]["loaded"], name
        _assert_same_run(one[name], third[name])


def test_a_failed_compile_is_retried_once_in_a_fresh_cache_directory(caplog, monkeypatch, tmp_path):
    """The retry itself, without a damaged directory to make (the slow tests above make them)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the fresh directory goes
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/nonexistent/graphamp-test-cache")
    dirs = []

    damaged = tmp_path / "cdamaged.py"  # generated code cut short, as a killed writer leaves it
    damaged.write_bytes(b"def call(args):\n    ret" + b"\x00damaged\xff")

    def compile_once():
        dirs.append(cache_dir())
        if len(dirs) == 1:  # inductor imports its generated code through PyCodeCache
            PyCodeCache.load_by_key_path("damaged", str(damaged))
        return "compiled"

    with caplog.at_level(logging.WARNING, logger="graphamp"):
        assert rebuild_if_cache_unreadable("G", compile_once) == "compiled"
    assert dirs[0] == "/nonexistent/graphamp-test-cache"
    assert os.path.dirname(dirs[1]) == str(tmp_path) and os.path.isdir(dirs[1])
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "G: compiling the step failed (RuntimeError: Failed to import" in warning, warning
    assert "/nonexistent/graphamp-test-cache" in warning
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/nonexistent/graphamp-test-cache"


def test_a_failure_the_retry_repeats_is_raised_and_out_of_memory_is_not_retried(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls = []
    missing = str(tmp_path / "cmissing.py")

    def broken():  # fails in the cache's reader both times: retried once, then raised
        calls.append(1)
        PyCodeCache.load_by_key_path(f"missing{len(calls)}", missing)

    with pytest.raises(Exception, match="missing"):
        rebuild_if_cache_unreadable("G", broken)
    assert len(calls) == 2
    calls.clear()

    def compiler_bug():  # raised in the compiler's own graph work, no cache file read
        calls.append(1)
        from torch._inductor import scheduler

        scheduler._real_dep_names(None)  # raises inside inductor's scheduler

    with pytest.raises(TypeError):
        rebuild_if_cache_unreadable("G", compiler_bug)
    assert len(calls) == 1
    calls.clear()

    def elsewhere():  # an unknown place: a damaged file fails wherever its content is used
        calls.append(1)
        raise ValueError(f"failure {len(calls)}")

    with pytest.raises(ValueError, match="failure 2"):
        rebuild_if_cache_unreadable("G", elsewhere)
    calls.clear()

    def out_of_memory():
        calls.append(1)
        raise torch.OutOfMemoryError("no memory")

    with pytest.raises(torch.OutOfMemoryError):
        rebuild_if_cache_unreadable("G", out_of_memory)
    assert len(calls) == 1


def test_the_compile_line_counts_each_cache_s_events():
    from graphamp.backend.inductor_cache import cache_words

    changes = {
        "autograd_cache_miss": 1,
        "autograd_cache_saved": 1,
        "fxgraph_cache_hit": 2,
        "fxgraph_cache_miss": 1,
        "fxgraph_cache_bypass": 0,  # unchanged: not named
    }
    assert cache_words(changes) == (
        "AOTAutograd's cache: 1 miss, 1 saved; the FX-graph cache: 2 hits, 1 miss"
    )
    assert cache_words({}) == ""
