"""The benchmark workloads: the seed MLP, GPT-2 124M (a compact local definition), ResNet-50.

Each workload gives a model factory, an optimizer factory, a loss, a fixed set of batches on the
device, and the FLOPs of one training step where they are known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    make_optimizer: Callable[[nn.Module, bool], torch.optim.Optimizer]  # (model, fused)
    loss: Callable
    batches: list
    flops_per_step: float | None
    description: str


# -- GPT-2 (nanoGPT's layout: fused qkv projection, tanh GELU, tied embedding) ------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab=50304, seq=1024, layers=12, heads=12, dim=768):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.h = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt2(device, smoke=False, n_batches=4) -> Workload:
    cfg = dict(vocab=512, seq=64, layers=2, heads=4, dim=64) if smoke else {}
    batch, seq = (2, 64) if smoke else (8, 1024)
    vocab, layers, dim = cfg.get("vocab", 50304), cfg.get("layers", 12), cfg.get("dim", 768)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n_batches):
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)
        batches.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    model = GPT(**cfg) if cfg else None
    n_params = sum(p.numel() for n, p in (model or GPT()).named_parameters() if n != "wpe.weight")
    heads = cfg.get("heads", 12)
    # nanoGPT's estimate: 6N per token plus attention 12 * layers * heads * head_dim * seq
    flops = (6 * n_params + 12 * layers * heads * (dim // heads) * seq) * batch * seq
    return Workload(
        "gpt2-124m" if not smoke else "gpt-tiny",
        lambda: GPT(**cfg),
        lambda m, fused: torch.optim.AdamW(m.parameters(), lr=6e-4, weight_decay=0.1,
                                           betas=(0.9, 0.95), **({"fused": True} if fused else {})),
        lm_loss, batches, flops,
        f"GPT-2 {'tiny' if smoke else '124M'} (12 layers, 768 wide) batch {batch}, sequence {seq}, "
        "AdamW, SDPA attention" if not smoke else "tiny GPT smoke workload")


def seed_mlp(device, smoke=False, n_batches=16) -> Workload:
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(256, 10, generator=gen)
    batches = []
    for _ in range(n_batches):
        x = torch.randn(128, 256, generator=gen)
        batches.append((x.to(device), (x @ teacher).argmax(1).to(device)))
    flops = 6 * (256 * 128 + 128 * 10) * 128
    return Workload(
        "seed-mlp",
        lambda: nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)),
        lambda m, fused: torch.optim.SGD(m.parameters(), lr=1e-3,
                                         **({"fused": True} if fused else {})),
        F.cross_entropy, batches, flops,
        "OneFlow's AMP example: Linear 256-128-10, batch 128, SGD lr 1e-3")


def resnet50(device, smoke=False, n_batches=4) -> Workload:
    import torchvision

    batch, size = (2, 32) if smoke else (128, 224)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(batch, 3, size, size, generator=gen).to(device),
                torch.randint(0, 1000, (batch,), generator=gen).to(device))
               for _ in range(n_batches)]
    make = torchvision.models.resnet18 if smoke else torchvision.models.resnet50
    # 4.1 GMACs per 224x224 image forward; training is about three forwards
    flops = None if smoke else 3 * 2 * 4.11e9 * batch
    return Workload(
        "resnet50" if not smoke else "resnet18-tiny",
        lambda: make(num_classes=1000),
        lambda m, fused: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4,
                                         **({"fused": True} if fused else {})),
        F.cross_entropy, batches, flops,
        f"torchvision ResNet-50, batch {batch}, {size}x{size}, SGD momentum 0.9, BatchNorm"
        if not smoke else "torchvision ResNet-18 at 32x32 smoke workload")


WORKLOADS = {"mlp": seed_mlp, "gpt2": gpt2, "resnet50": resnet50}
