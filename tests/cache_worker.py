"""One process of tests/test_compile_cache.py: train a few steps with inductor on the inductor
cache directory the test set (TORCHINDUCTOR_CACHE_DIR), save what came out.

    python tests/cache_worker.py CASE[,CASE...] OUT.pt

Cases run one after the other in this process, each with a fresh Graph and seed; each case's
entry holds its losses, its model's state and what inductor's caches did while it ran.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import make_graph
from models import Block, TinyGPT, lm_loss, seed_mlp, tiny_gpt2

import graphamp


def _masked_ce(g, x, y):
    keep = y >= 0  # data-dependent (unbacked) sizes: the compile path's other branch
    loss = F.cross_entropy(g.model(x)[keep], y[keep])
    loss.backward()
    return loss


def _small_mlp(hidden: int = 64, act: type[nn.Module] = nn.ReLU) -> nn.Module:
    return nn.Sequential(nn.Linear(32, hidden), act(), nn.Linear(hidden, 4))


# the base step, and steps that differ from it in one thing each: none may be served the base's
# cache entry. "other_torch" is the base step under another torch build's key.
VARIANTS = {
    "base": {},
    "wider": {"hidden": 96},
    "gelu": {"act": nn.GELU},
    "fp16": {"amp": torch.float16},
    "pinned": {"configure": lambda g: g.config.pin_fp32("model.2")},
    "other_torch": {},
}


def _variant(name: str, gen: torch.Generator):
    spec = dict(VARIANTS[name])
    model = _small_mlp(spec.pop("hidden", 64), spec.pop("act", nn.ReLU))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    spec.setdefault("amp", torch.bfloat16)
    g = make_graph(model, nn.CrossEntropyLoss(), opt, backend="inductor", **spec)
    batches = [
        (torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen))
        for _ in range(3)
    ]
    return g, batches


def case(name: str):
    """(graph, batches) of a case."""
    gen = torch.Generator().manual_seed(1)
    if name in VARIANTS:
        return _variant(name, gen)
    if name in ("fp16_scaler_adamw", "fp16_scaler_adamw_inlined", "fp16_scaler_adamw_fused"):
        model = seed_mlp()
        fused = name.endswith("_fused") or None  # torch's fused kernel, one op of the step
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=fused)
        inlined = name.endswith("_inlined")  # the step as assembly traced it, not a copy
        g = make_graph(
            model,
            nn.CrossEntropyLoss(),
            opt,
            backend="inductor",
            amp=torch.float16,
            scaler=graphamp.GradScaler(),
            configure=(lambda g: g.config.set_outline_blocks(False)) if inlined else None,
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
    if name in REAL_MODELS:
        return _real_model(name, gen)
    if name in ("dynamic_tinygpt", "checkpointed_tinygpt"):
        return _tinygpt(name, gen)
    raise ValueError(name)


def _tinygpt(name: str, gen: torch.Generator):
    """TinyGPT on inductor, bf16, AdamW: over three sequence lengths (a static step, then one
    with the length symbolic), or with its blocks checkpointed (recomputed in the backward)."""
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    checkpointed = name == "checkpointed_tinygpt"
    g = make_graph(
        model,
        lm_loss,
        opt,
        backend="inductor",
        amp=torch.bfloat16,
        configure=(lambda g: g.config.enable_activation_checkpointing(Block))
        if checkpointed
        else None,
    )
    lengths = [16, 16] if checkpointed else [16, 12, 8]
    batches = [
        (torch.randint(0, 64, (4, t), generator=gen), torch.randint(0, 64, (4, t), generator=gen))
        for t in lengths
    ]
    return g, batches


# real models for the step cache's restart (aot_eager: the assembled step is what is cached)
REAL_MODELS = ("hf_gpt2", "resnet18")


def _real_model(name: str, gen: torch.Generator):
    if name == "hf_gpt2":
        model = tiny_gpt2("eager", n_layer=3, resid_pdrop=0.1)

        def build(g, x, y):
            loss = g.model(x, labels=y).loss
            loss.backward()
            return loss

        idx = [torch.randint(0, 64, (4, 16), generator=gen) for _ in range(3)]
        batches = [(x, x) for x in idx]
    else:
        import torchvision

        model = torchvision.models.resnet18(num_classes=10)

        def build(g, x, y):
            loss = F.cross_entropy(g.model(x), y)
            loss.backward()
            return loss

        batches = [
            (torch.randn(2, 3, 32, 32, generator=gen), torch.randint(0, 10, (2,), generator=gen))
            for _ in range(3)
        ]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = make_graph(model, None, opt, backend="aot_eager", amp=torch.bfloat16, build=build)
    return g, batches


def _cache_counters() -> dict[str, int]:
    import torch._dynamo.utils

    counters = torch._dynamo.utils.counters
    return {
        k: v
        for k, v in {**counters["inductor"], **counters["aot_autograd"]}.items()
        if "cache" in k
    }


def run_case(name: str) -> dict:
    if name == "other_torch":  # what a restart after a torch upgrade looks like to inductor
        from torch._inductor.codecache import torch_key

        torch_key.clear()
        torch_key.set(b"another torch build")
        torch.version.git_version = "another torch build"  # graphamp's step cache key
    torch.manual_seed(0)
    before = _cache_counters()
    g, batches = case(name)
    # graphamp's INFO lines counted; its warnings still on stderr, as without a handler (the
    # tests read them there)
    remembered, log = _CompileLines(), logging.getLogger("graphamp")
    warnings = logging.StreamHandler(sys.stderr)
    warnings.setLevel(logging.WARNING)
    level = log.level
    log.addHandler(remembered)
    log.addHandler(warnings)
    log.setLevel(logging.INFO)
    try:
        losses = [g(x, y).detach().clone() for x, y in batches]
    finally:
        log.removeHandler(remembered)
        log.removeHandler(warnings)
        log.setLevel(level)
    after = _cache_counters()
    return {
        "losses": losses,
        "state": {k: v.clone() for k, v in g.model.state_dict().items()},
        "cache": {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)},
        "programs": len(g.compiled_steps),
        # the step came from graphamp's step cache (assembly skipped)
        "loaded": "assemble" not in g.compiled_steps[-1].timings,
        "all_loaded": all("assemble" not in p.timings for p in g.compiled_steps),
        # compiles that took AOTAutograd's key from the step cache's note (backend/aot_key.py)
        "remembered": remembered.count,
    }


class _CompileLines(logging.Handler):
    """Counts the compile lines that say AOTAutograd's key was remembered."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "AOTAutograd's key remembered" in record.getMessage():
            self.count += 1


def main(names: str, out: str) -> None:
    torch.save({"cases": {name: run_case(name) for name in names.split(",")}}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
