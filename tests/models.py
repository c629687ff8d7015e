"""Small real models the tests train: the seed MLP, a CNN with BatchNorm, a GPT-style LM."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def seed_mlp() -> nn.Module:
    """The OneFlow AMP example's model."""
    return nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


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
