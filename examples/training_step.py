"""A training step without a subclass: @graphamp.training_step on a plain function.

    python examples/training_step.py [--tiny]

A character model on the text Python ships (pydoc's topics): the next character from the
previous eight. fp16 AMP with a grad scaler, AdamW with a cosine schedule and clipping after
unscale; then the same inspection as any Graph.
"""

import pydoc_data.topics as topics

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import parse

import graphamp

args = parse(__doc__.splitlines()[0], steps=2000)
text = "".join(topics.topics[k] for k in sorted(topics.topics)).encode("ascii", "replace")
data = torch.tensor(list(text), dtype=torch.long, device=args.device)
context, width, batch = 8, (32 if args.tiny else 256), (64 if args.tiny else 1024)
model = nn.Sequential(
    nn.Embedding(256, width),
    nn.Flatten(),
    nn.Linear(context * width, 4 * width),
    nn.GELU(),
    nn.Linear(4 * width, 256),
).to(args.device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)


@graphamp.training_step(
    model,
    opt,
    amp=torch.float16,
    scaler=graphamp.GradScaler(),
    lr_sch=sch,
    clip_grad_max_norm=1.0,
)
def train_step(chars, next_char):
    loss = F.cross_entropy(model(chars), next_char)
    loss.backward()
    return loss


train_step.config.set_backend(args.backend)  # train_step is a graphamp.Graph
for _ in range(args.steps):
    start = torch.randint(0, data.numel() - context - 1, (batch, 1), device=args.device)
    window = data[start + torch.arange(context + 1, device=args.device)]
    loss = train_step(window[:, :-1], window[:, -1])
print(train_step.precision_report(with_autocast=False).summary())
history = train_step.history.fetch()
print(
    f"{train_step.step_count} steps, loss {history['loss'][0]:.3f} -> {history['loss'][-1]:.3f}, "
    f"{int(sum(history['skipped']))} skipped, {len(train_step.compiled_steps)} compiled step(s)"
)
