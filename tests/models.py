"""Small real models the tests train (the seed MLP, other MLPs, a CNN with BatchNorm, a GPT-style
LM) and the random classification batches they train on."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp(
    *widths: int,
    act: type[nn.Module] = nn.ReLU,
    norm: type[nn.Module] | None = None,
    bias: bool = True,
    act_last: bool = False,
    seed: int | None = None,
) -> nn.Sequential:
    """Linear layers through ``widths`` (``mlp(16, 12, 4)``: 16 -> 12 -> 4), each hidden one
    followed by ``norm(width)`` when given, then ``act()``; ``act_last`` puts an ``act()`` after
    the last one too. With ``seed``, torch.manual_seed(seed) first: the same weights whatever
    ran before. The layers are made (their weights drawn) in order, as nn.Sequential lists them."""
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[nn.Module] = []
    last = len(widths) - 2
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b, bias=bias))
        if i < last and norm is not None:
            layers.append(norm(b))
        if i < last or act_last:
            layers.append(act())
    return nn.Sequential(*layers)


def seed_mlp() -> nn.Module:
    """The OneFlow AMP example's model."""
    return mlp(256, 128, 10)


def batches(
    n: int, batch: int, d_in: int | tuple[int, ...], classes: int, *, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` classification batches ``(x, y)``: x of shape ``(batch, d_in)`` (``(batch, *d_in)``
    for a tuple) from N(0, 1), y of shape ``(batch,)`` in ``[0, classes)``; drawn x then y, batch
    after batch, from one generator seeded ``seed`` (torch's global generator is not used)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, d_in) if isinstance(d_in, int) else (batch, *d_in)
    return [
        (torch.randn(*shape, generator=gen), torch.randint(0, classes, (batch,), generator=gen))
        for _ in range(n)
    ]


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10, dropout: float = 0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = self.pool(self.features(x)).flatten(1)
        return self.head(self.drop(x))


class Block(nn.Module):
    """A pre-LayerNorm transformer block with separate q/k/v projections and SDPA."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        # No key bias: its gradient is exactly zero (softmax ignores a shift shared by all keys),
        # so any two implementations differ only in rounding noise, which Adam turns into ±lr.
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.dropout = dropout

    def forward(self, x):
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = (
            lin(h).view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for lin in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return x


class ManualAttentionBlock(Block):
    """The same block with attention written out (matmul, scale, mask, softmax)."""

    def forward(self, x):
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = (
            lin(h).view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for lin in (self.q, self.k, self.v)
        )
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = att @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return x


class TinyGPT(nn.Module):
    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        heads: int = 4,
        layers: int = 2,
        seq: int = 16,
        block: type = Block,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tiny_gpt2(attn: str | None = None, **overrides):
    """transformers' GPT2LMHeadModel built from a config (no download): 2 layers of width 32,
    a vocabulary of 64, no dropout, unless ``overrides`` say otherwise; ``attn`` picks the
    attention implementation ("eager", "sdpa")."""
    import transformers

    settings = dict(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config = transformers.GPT2Config(**{**settings, **overrides})
    if attn is not None:
        config._attn_implementation = attn
    return transformers.GPT2LMHeadModel(config)
