"""The benchmark workloads: the seed MLP, GPT-2 124M (a compact local definition), ResNet-50,
and a 1.1B-parameter Llama-style decoder (transformers' LlamaForCausalLM from a config).

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
    tokens_per_step: int | None = None  # language models: tokens trained on per step


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
    if smoke:
        return _gpt_workload(
            "gpt-tiny",
            dict(vocab=512, seq=64, layers=2, heads=4, dim=64),
            2,
            device,
            n_batches,
            "tiny GPT smoke workload",
        )
    batch, seq = 8, 1024
    return _gpt_workload(
        "gpt2-124m",
        dict(vocab=50304, seq=seq, layers=12, heads=12, dim=768),
        batch,
        device,
        n_batches,
        f"GPT-2 124M (12 layers, 768 wide) batch {batch}, sequence {seq}, AdamW, SDPA attention",
    )


def gpt2_6l(device, smoke=False, n_batches=4) -> Workload:
    """Issue 15's small GPT for CPU measurements (first call, kernels per step): GPT-2's layout
    and vocabulary, 6 layers, n_embd 128, 4 heads, B8 T64, AdamW (the smoke size is gpt2's)."""
    if smoke:
        return gpt2(device, smoke=True, n_batches=n_batches)
    return _gpt_workload(
        "gpt2-6l",
        dict(vocab=50304, seq=64, layers=6, heads=4, dim=128),
        8,
        device,
        n_batches,
        "GPT-2 layout, 6 layers, n_embd 128, 4 heads, vocab 50304, B8 T64, AdamW",
    )


def _gpt_workload(name, cfg, batch, device, n_batches, description) -> Workload:
    """A GPT of ``cfg`` trained with nanoGPT's AdamW on random tokens of length cfg["seq"]."""
    seq = cfg["seq"]
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n_batches):
        idx = torch.randint(0, cfg["vocab"], (batch, seq + 1), generator=gen).to(device)
        batches.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    n_params = sum(p.numel() for n, p in GPT(**cfg).named_parameters() if n != "wpe.weight")
    # nanoGPT's estimate: 6N per token plus attention 12 * layers * heads * head_dim * seq
    flops = (6 * n_params + 12 * cfg["layers"] * cfg["dim"] * seq) * batch * seq
    return Workload(
        name,
        lambda: GPT(**cfg),
        lambda m, fused: torch.optim.AdamW(
            m.parameters(),
            lr=6e-4,
            weight_decay=0.1,
            betas=(0.9, 0.95),
            **({"fused": True} if fused else {}),
        ),
        lm_loss,
        batches,
        flops,
        description,
        batch * seq,
    )


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
        lambda m, fused: torch.optim.SGD(
            m.parameters(), lr=1e-3, **({"fused": True} if fused else {})
        ),
        F.cross_entropy,
        batches,
        flops,
        "OneFlow's AMP example: Linear 256-128-10, batch 128, SGD lr 1e-3",
    )


def resnet50(device, smoke=False, n_batches=4) -> Workload:
    import torchvision

    batch, size = (2, 32) if smoke else (128, 224)
    gen = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randn(batch, 3, size, size, generator=gen).to(device),
            torch.randint(0, 1000, (batch,), generator=gen).to(device),
        )
        for _ in range(n_batches)
    ]
    make = torchvision.models.resnet18 if smoke else torchvision.models.resnet50
    # 4.1 GMACs per 224x224 image forward; training is about three forwards
    flops = None if smoke else 3 * 2 * 4.11e9 * batch
    return Workload(
        "resnet50" if not smoke else "resnet18-tiny",
        lambda: make(num_classes=1000),
        # never fused: torch's fused SGD with momentum keeps an uninitialised momentum buffer
        # when GradScaler skips its first step (fp16's usual first overflow), and the peer's
        # loss was NaN from step 20 on the H200 (h200-round3/README.md); foreach is correct
        lambda m, fused: torch.optim.SGD(
            m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True
        ),
        F.cross_entropy,
        batches,
        flops,
        f"torchvision ResNet-50, batch {batch}, {size}x{size}, SGD momentum 0.9, BatchNorm"
        if not smoke
        else "torchvision ResNet-18 at 32x32 smoke workload",
    )


class LlamaLM(nn.Module):
    """transformers' LlamaForCausalLM returning its logits (the loss is the workload's)."""

    def __init__(self, config):
        super().__init__()
        import transformers

        self.lm = transformers.LlamaForCausalLM(config)

    def forward(self, idx):
        return self.lm(input_ids=idx, use_cache=False).logits


def llama_1b(device, smoke=False, n_batches=4) -> Workload:
    """TinyLlama-1.1B's shape (22 layers, width 2048, 32 heads, 4 KV heads, SwiGLU 5632, vocab
    32000) from a config, random weights; B4 T2048, AdamW. FLOPs: nanoGPT's estimate, as for
    GPT-2 (6N per token plus 12 * layers * width * sequence)."""
    import transformers

    dims = (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
        )
        if smoke
        else dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            vocab_size=32000,
        )
    )
    batch, seq = (2, 64) if smoke else (4, 2048)
    config = transformers.LlamaConfig(
        **dims,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n_batches):
        idx = torch.randint(0, dims["vocab_size"], (batch, seq + 1), generator=gen).to(device)
        batches.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    with torch.device("meta"):
        n_params = sum(p.numel() for p in LlamaLM(config).parameters())
    layers, width = dims["num_hidden_layers"], dims["hidden_size"]
    flops = (6 * n_params + 12 * layers * width * seq) * batch * seq
    return Workload(
        "llama-1b" if not smoke else "llama-tiny",
        lambda: LlamaLM(config),
        lambda m, fused: torch.optim.AdamW(
            m.parameters(),
            lr=3e-4,
            weight_decay=0.1,
            betas=(0.9, 0.95),
            **({"fused": True} if fused else {}),
        ),
        lm_loss,
        batches,
        flops,
        f"Llama-style decoder {n_params / 1e9:.2f}B (TinyLlama-1.1B shape), B{batch} T{seq}, AdamW"
        if not smoke
        else "tiny Llama smoke workload",
        batch * seq,
    )


WORKLOADS = {
    "mlp": seed_mlp,
    "gpt2": gpt2,
    "gpt2-6l": gpt2_6l,
    "resnet50": resnet50,
    "llama1b": llama_1b,
}
