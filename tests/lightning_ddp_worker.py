"""Run by tests/test_trainer_lightning.py: Lightning's Trainer with strategy="ddp" on 2 CPU
processes (gloo), which Lightning starts itself by running this script again:

    python tests/lightning_ddp_worker.py KIND OUT

KIND: stock (a LightningModule with automatic optimization) or ours (GraphampModule), the
modules of test_trainer_lightning.py. Rank 0 writes the logged losses and the final parameters
to OUT.
"""

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_trainer_lightning import Ours, Stock, _fit


def main(kind: str, out: str) -> None:
    warnings.simplefilter("ignore")
    module = Ours() if kind == "ours" else Stock()
    trainer, rows = _fit(
        module,
        os.path.dirname(out),
        devices=2,
        strategy="ddp",
        enable_checkpointing=False,
        gradient_clip_val=1.0 if kind == "stock" else None,
    )
    if trainer.global_rank == 0:
        torch.save(
            {
                "world_size": trainer.world_size,
                "global_step": trainer.global_step,
                "loss": [row["train_loss"] for row in rows],
                "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            },
            out,
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
