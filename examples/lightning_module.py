"""PyTorch Lightning with graphamp: a LightningModule whose step graphamp compiles.

    python examples/lightning_module.py [--tiny]

The module subclasses graphamp's GraphampModule instead of LightningModule and writes
``training_loss`` (the forward and the loss) instead of ``training_step``; Lightning's Trainer,
precision flag, logging, validation, callbacks and checkpoints stay as they are.
"""

import tempfile

import lightning.pytorch as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import parse
from sklearn.datasets import load_digits

from graphamp.integrations.lightning import GraphampModule


class DigitsClassifier(GraphampModule):  # was: L.LightningModule
    def __init__(self, steps: int, backend: str):
        super().__init__()
        self.steps = steps
        self.model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))
        self.clip_grad_max_norm = 1.0  # was: Trainer(gradient_clip_val=1.0)
        self.backend = backend

    def training_loss(self, batch):  # was: training_step, with self.log("train_loss", loss)
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.model(x).argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sch = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}

    def configure_graph(self, graph):  # graphamp's own options (here: the backend)
        graph.config.set_backend(self.backend)


args = parse(__doc__.splitlines()[0], steps=600)
x, y = load_digits(return_X_y=True)
x = torch.tensor(x / 16.0, dtype=torch.float32)
y = torch.tensor(y)
train = torch.utils.data.TensorDataset(x[:1500], y[:1500])
val = torch.utils.data.TensorDataset(x[1500:], y[1500:])
loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True, drop_last=True)

module = DigitsClassifier(args.steps, args.backend)
with tempfile.TemporaryDirectory() as root:
    trainer = L.Trainer(
        max_steps=args.steps,
        precision="bf16-mixed",
        accelerator=args.device.type,
        devices=1,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=min(args.steps, len(loader)),
    )
    trainer.fit(module, loader, torch.utils.data.DataLoader(val, batch_size=256))
    metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
    print(f"{trainer.global_step} steps: {metrics}")
    print(module.graph.precision_report(with_autocast=False).summary())
    print(f"checkpoint: {trainer.checkpoint_callback.best_model_path.rsplit('/', 1)[-1]}")
