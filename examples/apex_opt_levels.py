"""apex's opt levels in graphamp, side by side: O0 fp32, O1 lists, O2 almost all fp16, O3 all.

Trains the same small transformer LM at each level and prints, per level, how many ops run in
low precision, how many casts the forward has, and the loss. apex O1 patched functions by lists
(graphamp O1: the precision lists); O2 cast the model to fp16 except BatchNorm (graphamp O2:
everything but deny ops and pinned modules, fp32 master weights kept); O3 was pure fp16, a speed
baseline (graphamp O3: every op low precision).

    python examples/apex_opt_levels.py [--tiny]
"""

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import parse

import graphamp

args = parse(__doc__.splitlines()[0], steps=200)
vocab, dim, seq, batch = (64, 32, 16, 4) if args.tiny else (8192, 512, 256, 16)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, 4, c // 4).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2)
        )
        att = (
            (q @ k.transpose(-2, -1) / math.sqrt(c // 4))
            .masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            .softmax(-1)
        )
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


base = nn.Sequential(
    nn.Embedding(vocab, dim), Block(), Block(), nn.LayerNorm(dim), nn.Linear(dim, vocab)
).to(args.device)
tokens = torch.randint(0, vocab, (batch, seq + 1), device=args.device)

print(f"{'level':6s} {'low-precision ops':>18s} {'casts':>6s} {'loss first -> last':>20s}")
for level in ("O0", "O1", "O2", "O3"):
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    class LM(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_amp(True)
            self.config.set_amp_opt_level(level)
            self.config.set_backend(args.backend)
            if level != "O0":
                self.set_grad_scaler(graphamp.GradScaler())

        def build(self, x, y):
            logits = self.model(x)
            loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
            loss.backward()
            return loss

    lm = LM()
    losses = [lm(tokens[:, :-1], tokens[:, 1:]) for _ in range(args.steps)]
    report = lm.precision_report(with_autocast=False)
    print(
        f"{level:6s} {report.ops_low:>8d} / {report.ops_total:<8d} {report.casts:>6d} "
        f"{losses[0].item():>9.3f} -> {losses[-1].item():.3f}"
    )
