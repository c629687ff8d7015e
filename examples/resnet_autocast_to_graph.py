"""The torch.autocast + GradScaler ResNet loop, rewritten as a graphamp Graph.

The loop people write today (seed 001):

    scaler = torch.cuda.amp.GradScaler()
    for images, target in loader:
        optimizer.zero_grad()
        with torch.cuda.amp.autocast():
            output = model(images)
            loss = criterion(output, target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    scheduler.step()

becomes one build() with the same model, criterion, optimizer and scheduler; graphamp runs
autocast's job (precision), GradScaler's job (scale, unscale, skip, update) and the optimizer
step inside one compiled program. Synthetic ImageNet-shaped data; torchvision ResNet-50.

    python examples/resnet_autocast_to_graph.py          # GPU: ResNet-50, batch 64, 224x224
    python examples/resnet_autocast_to_graph.py --tiny   # CPU: ResNet-18, 32x32, a few steps
"""

import os
import tempfile

import torch
import torch.nn as nn
import torchvision
from _common import parse

import graphamp

args = parse(__doc__.splitlines()[0], steps=100)
args.steps = max(args.steps, 8)
batch, size = (4, 32) if args.tiny else (64, 224)
model = (torchvision.models.resnet18 if args.tiny else torchvision.models.resnet50)()
model = model.to(args.device)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)


class ResNetTrain(graphamp.Graph):
    def __init__(self):
        super().__init__()
        self.model = model
        self.criterion = criterion
        self.add_optimizer(optimizer, lr_sch=scheduler)  # scheduler.step() after each call
        self.config.enable_amp(True)  # was: with autocast()
        self.config.set_backend(args.backend)
        self.set_grad_scaler(graphamp.GradScaler())  # was: scale/step/update

    def build(self, images, target):
        output = self.model(images)
        loss = self.criterion(output, target)
        loss.backward()
        return loss


train = ResNetTrain()
images = torch.randn(batch, 3, size, size, device=args.device)
target = torch.randint(0, 1000, (batch,), device=args.device)
losses = [train(images, target) for _ in range(args.steps)]
history = train.history.fetch()
print(train.precision_report(with_autocast=False).summary())
# The first steps overflow at the default initial scale 2**16 and are skipped (as with torch's
# GradScaler) while the scale backs off; the history shows it without a single host sync.
print(
    f"loss {losses[0].item():.3f} -> {losses[-1].item():.3f}; skipped "
    f"{int(sum(history['skipped']))} of {len(history['step'])} steps; scale "
    f"{history['scale'][0]:g} -> {train.grad_scaler.get_scale():g}; "
    f"lr {optimizer.param_groups[0]['lr']}"
)
checkpoint = os.path.join(tempfile.gettempdir(), "graphamp_resnet_checkpoint.pt")
torch.save(
    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "graph": train.state_dict()},
    checkpoint,
)  # ordinary torch checkpoint, three parts
