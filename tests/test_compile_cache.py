"""Issue 31: a restart on the same inductor cache directory reuses the compiled step.

inductor's FX-graph cache and AOTAutograd's cache bypass themselves unless the backend runs in a
TracingContext whose fake mode has a ShapeEnv; compile_step gives it one, with the step's own
static fake inputs (real inputs would be fakified again with a symbol per dimension, which broke
AOTAutograd's tensorify_python_scalars).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch._guards import TracingContext
from torch._subclasses.fake_tensor import FakeTensor

from graphamp.records.fxutil import trace_functional
from graphamp.runtime.compile import compile_step

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


def _run_worker(case: str, cache_dir, out) -> dict:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "cache_worker.py"), case, str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.inductor
@pytest.mark.parametrize("case", ["fp16_scaler_adamw", "masked_bf16_sgd"])
def test_restart_hits_inductor_and_aot_autograd_caches(case, tmp_path):
    cache_dir = tmp_path / "inductor-cache"
    cold = _run_worker(case, cache_dir, tmp_path / "cold.pt")
    warm = _run_worker(case, cache_dir, tmp_path / "warm.pt")
    assert cold["cache"].get("fxgraph_cache_miss") == 1, cold["cache"]
    assert cold["cache"].get("autograd_cache_saved") == 1, cold["cache"]
    assert warm["cache"].get("fxgraph_cache_hit") == 1, warm["cache"]
    assert warm["cache"].get("autograd_cache_hit") == 1, warm["cache"]
    assert not any("bypass" in k for k in {**cold["cache"], **warm["cache"]})
    assert cold["programs"] == warm["programs"] == 1
    # the program loaded from the cache computes what the freshly compiled one did, bitwise
    for a, b in zip(cold["losses"], warm["losses"]):
        assert torch.equal(a, b)
    for key, value in cold["state"].items():
        assert torch.equal(value, warm["state"][key]), key
