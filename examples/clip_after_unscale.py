"""insightface's recipe in a Graph: a max-capped GradScaler and clipping after unscale.

insightface trains a backbone and a margin-softmax head with two optimizers, a
MaxClipGradScaler (dynamic scaling capped at 128 x batch size) and
``clip_grad_norm_(backbone.parameters(), max_norm=5)`` after ``grad_scaler.unscale_``. Here the
cap is ``GradScaler(max_scale=...)`` and the clipping ``add_optimizer(..., clip_grad_max_norm=5)``:
graphamp always clips after unscaling, inside the step, and a non-finite norm skips the step.

    python examples/clip_after_unscale.py [--tiny]
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import parse

import graphamp

args = parse(__doc__.splitlines()[0], steps=300)
batch, classes, embedding = (8, 50, 32) if args.tiny else (128, 10_000, 512)
backbone = nn.Sequential(
    nn.Conv2d(3, 32, 3, stride=2, padding=1),
    nn.BatchNorm2d(32),
    nn.PReLU(32),
    nn.Conv2d(32, 64, 3, stride=2, padding=1),
    nn.BatchNorm2d(64),
    nn.PReLU(64),
    nn.AdaptiveAvgPool2d(1),
    nn.Flatten(),
    nn.Linear(64, embedding),
    nn.BatchNorm1d(embedding),
).to(args.device)


class ArcFace(nn.Module):
    """Additive angular margin softmax (the head insightface's partial FC computes)."""

    def __init__(self, dim, classes, s=64.0, m=0.5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, dim) * 0.01)
        self.s, self.m = s, m

    def forward(self, features, labels):
        cos = F.linear(F.normalize(features), F.normalize(self.weight)).clamp(-1 + 1e-7, 1 - 1e-7)
        target = torch.cos(torch.acos(cos) + self.m)
        one_hot = F.one_hot(labels, cos.shape[1]).to(cos.dtype)
        return F.cross_entropy(self.s * torch.where(one_hot.bool(), target, cos), labels)


head = ArcFace(embedding, classes).to(args.device)
opt_backbone = torch.optim.SGD(backbone.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
opt_pfc = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)


class FaceTrain(graphamp.Graph):
    def __init__(self):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.add_optimizer(opt_backbone, clip_grad_max_norm=5.0, clip_grad_norm_type=2.0)
        self.add_optimizer(opt_pfc)
        self.config.enable_amp(True)
        self.config.set_backend(args.backend)
        # MaxClipGradScaler(batch_size, 128 * batch_size, growth_interval=100)
        self.set_grad_scaler(
            graphamp.GradScaler(
                init_scale=batch, max_scale=128 * batch, growth_interval=100, min_scale=1.0
            )
        )

    def build(self, images, labels):
        loss = self.head(self.backbone(images), labels)
        loss.backward()
        return loss


train = FaceTrain()
images = torch.randn(batch, 3, 32, 32, device=args.device)
labels = torch.randint(0, classes, (batch,), device=args.device)
for _ in range(args.steps):
    train(images, labels)
history = train.history.fetch()
print(
    f"scale {history['scale'][0]} -> {history['scale'][-1]} (cap {128 * batch}); "
    f"skipped {int(sum(history['skipped']))}; backbone grad norm (before clipping) "
    f"{history['grad_norm'][-1]:.3f}; loss {history['loss'][0]:.3f} -> {history['loss'][-1]:.3f}"
)
