"""Run by tests/test_trainer_lightning.py: Lightning's Trainer with strategy="ddp" on 2 CPU
processes (gloo), which Lightning starts itself by running this script again:

    python tests/lightning_ddp_worker.py KIND OUT

KIND: stock (a LightningModule with automatic optimization) or ours (GraphampModule), the
modules of test_trainer_lightning.py; ours-zero3 is ours with graphamp's ZeRO-3 set in
configure_graph, Lightning's checkpointing on and a validation run after training. Rank 0
writes the logged losses, the final (whole) parameters and the validation loss to OUT.
"""

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch.nn.functional as F
from test_trainer_lightning import Ours, Stock, _fit, _loader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


class OursZero3(Ours):
    def configure_graph(self, graph):
        super().configure_graph(graph)
        graph.config.enable_zero(stage=3)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y), sync_dist=True)


def main(kind: str, out: str) -> None:
    warnings.simplefilter("ignore")
    module = {"ours": Ours, "ours-zero3": OursZero3}.get(kind, Stock)()
    trainer, rows = _fit(
        module,
        os.path.dirname(out),
        devices=2,
        strategy="ddp",
        enable_checkpointing=kind == "ours-zero3",
        gradient_clip_val=1.0 if kind == "stock" else None,
    )
    validated = trainer.validate(module, _loader()) if kind == "ours-zero3" else None
    # whole parameters on every rank (ZeRO-3's shards are gathered: a collective)
    whole = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    if trainer.global_rank == 0:
        torch.save(
            {
                "world_size": trainer.world_size,
                "global_step": trainer.global_step,
                "loss": [row["train_loss"] for row in rows],
                "params": {n: whole[n].detach().clone() for n, _ in module.named_parameters()},
                "val_loss": validated[0]["val_loss"] if validated else None,
                "sharded": any(hasattr(p, "device_mesh") for p in module.parameters()),
            },
            out,
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
