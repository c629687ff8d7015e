"""CUDA: correctness against eager autocast, CUDA-graph replay, and no host sync per step.

Marked ``gpu``; skipped cleanly on machines without CUDA (see conftest.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import autocast_step, make_graph
from models import SmallCNN, TinyGPT, lm_loss, seed_mlp

import graphamp

pytestmark = [pytest.mark.gpu]
CUDA = torch.device("cuda")


def _gpt_batch():
    idx = torch.randint(0, 64, (4, 17), device=CUDA)
    return idx[:, :-1], idx[:, 1:]


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_cuda_fp16_training_tracks_eager_autocast(backend):
    torch.manual_seed(0)
    model = TinyGPT().to(CUDA)
    ref = copy.deepcopy(model)
    # a scale that does not overflow: which steps overflow at 2**16 depends on fp16 rounding,
    # and a differently skipped step would make the trajectories differ for that reason alone
    g = make_graph(
        model,
        lm_loss,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        backend=backend,
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=1024.0),
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    batches = [_gpt_batch() for _ in range(4)]
    for step in range(20):
        x, y = batches[step % 4]
        loss = g(x, y)
        eager = autocast_step(
            lambda: lm_loss(ref(x), y), ref_opt, torch.float16, scaler, device_type="cuda"
        )
        torch.testing.assert_close(loss, eager.loss.float(), rtol=2e-2, atol=2e-2)
    assert sum(g.history.fetch()["skipped"]) == 0 and scaler.get_scale() == 1024.0
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3, msg=n)


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["cuda_graph", "no_cuda_graph"])
def test_steady_state_steps_never_sync_with_the_host(cuda_graph):
    model = SmallCNN().to(CUDA)
    sch_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sch = torch.optim.lr_scheduler.StepLR(sch_opt, step_size=1, gamma=0.9)
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        sch_opt,
        backend="inductor",
        amp=torch.float16,
        scaler=graphamp.GradScaler(),
        lr_sch=sch,
        clip=1.0,
        configure=lambda self: self.config.enable_cuda_graph(cuda_graph),
    )
    x = torch.randn(8, 3, 16, 16, device=CUDA)
    y = torch.randint(0, 10, (8,), device=CUDA)
    g(x, y)
    g(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            loss = g(x, y)  # a new lr every step (the scheduler): still no sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss)
    assert g.compiled_steps[-1].cuda_graph == cuda_graph


def test_cuda_graph_replay_updates_the_users_tensors_and_follows_reloads():
    model = seed_mlp().to(CUDA)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        opt,
        backend="inductor",
        amp=torch.float16,
        scaler=graphamp.GradScaler(),
    )
    x, y = torch.randn(128, 256, device=CUDA), torch.randint(0, 10, (128,), device=CUDA)
    g(x, y)
    assert g.compiled_steps[-1].cuda_graph
    w = model[0].weight.detach().clone()
    for _ in range(3):
        g(x, y)
    assert not torch.equal(w, model[0].weight)
    assert opt.state_dict()["state"][0]["step"].item() == 4.0
    # an ordinary checkpoint reload (new optimizer state tensors) is picked up by the next call
    saved = copy.deepcopy(opt.state_dict())
    model_state = copy.deepcopy(model.state_dict())
    g(x, y)
    model.load_state_dict(model_state)
    opt.load_state_dict(saved)
    g(x, y)
    assert opt.state_dict()["state"][0]["step"].item() == 5.0


def test_skipped_step_on_cuda_is_bitwise():
    model = SmallCNN().to(CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        opt,
        backend="inductor",
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=128.0),
    )
    x = torch.randn(8, 3, 16, 16, device=CUDA)
    y = torch.randint(0, 10, (8,), device=CUDA)
    g(x, y)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = x.clone()
    bad[0, 0, 0, 0] = float("inf")
    g(bad, y)
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v), k
    assert g.grad_scaler.get_scale() == 64.0


def test_a_cuda_step_is_inlined_by_default_and_outlined_when_asked():
    """On CUDA the default inlines repeated blocks (outlined, GPT-2 124M's steady step measured
    1.03-1.04x the inlined one on an H200); set_outline_blocks(True) still outlines, and both
    train alike."""

    def run(outline):
        torch.manual_seed(0)
        model = TinyGPT(layers=3).to(CUDA)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def configure(g):
            if outline is not None:
                g.config.set_outline_blocks(outline)

        g = make_graph(model, lm_loss, opt, amp=torch.bfloat16, configure=configure)
        torch.manual_seed(1)
        losses = [g(*_gpt_batch()) for _ in range(3)]
        graph = g.compiled_steps[-1].step_graph.graph
        calls = [n for n in graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
        return torch.stack(losses), calls

    default_losses, default_calls = run(None)
    outlined_losses, outlined_calls = run(True)
    assert default_calls == [] and len(outlined_calls) == 6  # 3 blocks, forward and backward
    torch.testing.assert_close(default_losses, outlined_losses, rtol=1e-2, atol=1e-2)
