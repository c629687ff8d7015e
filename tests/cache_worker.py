"""One process of tests/test_compile_cache.py: train a few steps with inductor on the inductor
cache directory the test set (TORCHINDUCTOR_CACHE_DIR), save what came out.

    python tests/cache_worker.py CASE OUT.pt
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import make_graph  # noqa: E402
from models import seed_mlp  # noqa: E402

import graphamp  # noqa: E402


def _masked_ce(g, x, y):
    keep = y >= 0  # data-dependent (unbacked) sizes: the compile path's other branch
    loss = F.cross_entropy(g.model(x)[keep], y[keep])
    loss.backward()
    return loss


def case(name: str):
    """(graph, batches) of a case."""
    gen = torch.Generator().manual_seed(1)
    if name == "fp16_scaler_adamw":
        model = seed_mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        g = make_graph(
            model,
            nn.CrossEntropyLoss(),
            opt,
            backend="inductor",
            amp=torch.float16,
            scaler=graphamp.GradScaler(),
        )
        batches = [
            (torch.randn(64, 256, generator=gen), torch.randint(0, 10, (64,), generator=gen))
            for _ in range(3)
        ]
        return g, batches
    if name == "masked_bf16_sgd":
        model = nn.Linear(16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = make_graph(model, None, opt, backend="inductor", amp=torch.bfloat16, build=_masked_ce)
        labels = [[0, -1, 2, 1, -1, 0], [-1, -1, 2, 1, -1, 3], [1, 2, 3, 0, 1, -1]]
        return g, [(torch.randn(6, 16, generator=gen), torch.tensor(y)) for y in labels]
    raise ValueError(name)


def main(name: str, out: str) -> None:
    import torch._dynamo.utils

    torch.manual_seed(0)
    g, batches = case(name)
    losses = [g(x, y).detach().clone() for x, y in batches]
    counters = torch._dynamo.utils.counters
    torch.save(
        {
            "losses": losses,
            "state": {k: v.clone() for k, v in g.model.state_dict().items()},
            "cache": {
                k: v
                for k, v in {**counters["inductor"], **counters["aot_autograd"]}.items()
                if "cache" in k
            },
            "programs": len(g.compiled_steps),
        },
        out,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
