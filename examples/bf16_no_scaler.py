"""bf16 mixed precision without a loss scaler: bf16 has fp32's exponent range, so small
gradients do not underflow and no scaling is needed.

    python examples/bf16_no_scaler.py [--tiny]
"""

import torch
import torch.nn as nn
from _common import parse

import graphamp

args = parse(__doc__.splitlines()[0], steps=500)
width = 64 if args.tiny else 1024
model = nn.Sequential(
    nn.Linear(width, 4 * width),
    nn.GELU(),
    nn.Linear(4 * width, width),
    nn.LayerNorm(width),
    nn.Linear(width, 10),
).to(args.device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)


class BF16Graph(graphamp.Graph):
    def __init__(self):
        super().__init__()
        self.model = model
        self.loss_fn = nn.CrossEntropyLoss()
        self.add_optimizer(opt, lr_sch=sch)
        self.config.enable_amp(True, dtype=torch.bfloat16)  # no set_grad_scaler: not needed
        self.config.set_backend(args.backend)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


g = BF16Graph()
teacher = torch.randn(width, 10, device=args.device)
for _step in range(args.steps):
    x = torch.randn(256, width, device=args.device)
    loss = g(x, (x @ teacher).argmax(1))
print(g.precision_report(with_autocast=False).summary())
print(f"final loss {loss.item():.3f}; grad scaler: {g.grad_scaler}")
