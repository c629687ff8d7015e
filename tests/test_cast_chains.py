"""Casts the user writes, in random chains over bool, integer and float dtypes, feeding an op
autocast runs in low precision (a matmul) and one graphamp runs in fp32 (log_softmax): graphamp's
AMP passes keep them as eager autocast computes them (``passes/fold_casts.py`` folds a chain
only where it starts from a float, dropping its low-precision round trips; a bool or an integer
made a number, as MoE routing does with ``(h > 0).to(x.dtype)``, keeps its conversion).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

import graphamp

_ANY = [torch.bool, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32]


class _Chain(nn.Module):
    def __init__(self, start: str, chain: list[torch.dtype]):
        super().__init__()
        self.start, self.chain = start, chain
        self.w = nn.Parameter(torch.randn(8, 5) * 0.3)

    def forward(self, x):
        if self.start == "bool":
            v = x > 0
        elif self.start == "int":
            v = (x * 4).to(torch.int64)
        else:
            v = x * 1.5
        for dtype in self.chain:
            v = v.to(dtype)
        return torch.matmul(v, self.w), torch.log_softmax(v, dim=-1)


def _case(seed: int) -> tuple[str, list[torch.dtype]]:
    """A start (a comparison's bool, an integer, a float) and casts ending in float32, the
    parameters' dtype, as code that must also run without autocast ends them
    (``.to(x.dtype)``)."""
    rng = random.Random(seed)
    middle = [rng.choice(_ANY) for _ in range(rng.randint(0, 3))]
    return rng.choice(["bool", "int", "float"]), [*middle, torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seed", range(24))
def test_a_random_cast_chain_computes_as_under_eager_autocast(seed, dtype):
    start, chain = _case(seed)
    torch.manual_seed(seed)
    model = _Chain(start, chain)

    class Eval(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.config.enable_amp(True, dtype=dtype)
            self.config.set_backend("eager")

        def build(self, x):
            return self.model(x)

    x = torch.randn(6, 8)
    ours = Eval()(x)
    with torch.autocast("cpu", dtype=dtype):
        theirs = model(x)
    # autocast's values exactly, where the chain starts from a bool or an integer; from a
    # float, graphamp drops the chain's low-precision round trips (fold_casts: it owns
    # precision under AMP), so within that dtype's rounding
    exact = start != "float" or not (set(chain) & {torch.float16, torch.bfloat16})
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 2e-2, "atol": 2e-2}
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b.float(), **tol, msg=lambda m: f"{start}, {chain}: {m}")


def test_moe_routing_weights_made_from_a_comparison_train_in_fp16_and_bf16():
    """A GShard-style gate: ``w = (h > 0).to(x.dtype)`` then an einsum with the experts."""

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4)
            self.experts = nn.Parameter(torch.randn(4, 8, 8) * 0.1)

        def forward(self, x):
            w = (self.gate(x) > 0).to(x.dtype)
            return torch.einsum("be,eio,bi->bo", w, self.experts, x)

    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        model = MoE()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = graphamp.GradScaler() if dtype == torch.float16 else None

        class Train(graphamp.Graph):
            def __init__(self):
                super().__init__()
                self.model = model
                self.add_optimizer(opt)
                self.config.enable_amp(True, dtype=dtype)
                self.config.set_backend("eager")
                if scaler is not None:
                    self.set_grad_scaler(scaler)

            def build(self, x, y):
                loss = nn.functional.mse_loss(self.model(x), y)
                loss.backward()
                return loss

        x, y = torch.randn(5, 8), torch.randn(5, 8)
        with torch.autocast("cpu", dtype=dtype):
            expected = nn.functional.mse_loss(model(x), y).float()
        loss = Train()(x, y)
        torch.testing.assert_close(loss, expected, rtol=1e-2, atol=1e-3)
