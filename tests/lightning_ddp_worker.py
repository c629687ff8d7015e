"""Run by tests/test_trainer_lightning.py: Lightning's Trainer with strategy="ddp" on 2 CPU
processes (gloo), which Lightning starts itself by running this script again:

    python tests/lightning_ddp_worker.py KIND OUT

KIND: stock (a LightningModule with automatic optimization) or ours (GraphampModule), the
modules of test_trainer_lightning.py; ours-zero3 is ours with graphamp's ZeRO-3 set in
configure_graph, Lightning's checkpointing on and a validation run after training; ours-fsdp2
is that under ModelParallelStrategy with FSDP2's fully_shard in configure_model (and
ours-mp-unwrapped with a configure_model that wraps nothing: data parallel); dcp-first,
dcp-resume and dcp-full resume it from Lightning's distributed checkpoint (``resume``). Rank 0
writes the logged losses, the final (whole) parameters and the validation loss to OUT.
"""

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch.nn.functional as F
from dist_worker import leave
from test_trainer_lightning import Ours, Stock, _fit, _loader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


class OursZero3(Ours):
    def configure_graph(self, graph):
        super().configure_graph(graph)
        graph.config.enable_zero(stage=3)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y), sync_dist=True)


class OursFsdp2(OursZero3):
    """FSDP2 as Lightning's docs write it: ModelParallelStrategy, and fully_shard per layer
    then the root in configure_model (which Lightning calls again for validate: idempotent)."""

    def configure_graph(self, graph):
        Ours.configure_graph(self, graph)  # the wrap makes the step ZeRO-3

    def configure_model(self):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from graphamp.sharding.rows import holds_shards

        if isinstance(self.model, FSDPModule) or holds_shards(self):
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class OursUnwrapped(OursFsdp2):
    """ModelParallelStrategy with a configure_model that wraps nothing: data parallel."""

    def configure_model(self):
        pass


def main(kind: str, out: str) -> None:
    warnings.simplefilter("ignore")
    kinds = {"ours": Ours, "ours-zero3": OursZero3, "ours-fsdp2": OursFsdp2}
    module = {**kinds, "ours-mp-unwrapped": OursUnwrapped}.get(kind, Stock)()
    strategy = "ddp"
    if kind in ("ours-fsdp2", "ours-mp-unwrapped"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        # one checkpoint file (whole tensors), which the test reads like ours-zero3's
        strategy = ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False
        )
    checkpoints = kind in ("ours-zero3", "ours-fsdp2", "ours-mp-unwrapped")
    trainer, rows = _fit(
        module,
        os.path.dirname(out),
        devices=2,
        strategy=strategy,
        enable_checkpointing=checkpoints,
        gradient_clip_val=1.0 if kind == "stock" else None,
    )
    validated = trainer.validate(module, _loader()) if checkpoints else None
    _save_whole(trainer, module, rows, validated, out)


def resume(kind: str, out: str) -> None:
    """ours-fsdp2 with ModelParallelStrategy's distributed checkpoint (DCP, each rank its
    shards): ``dcp-first`` trains one epoch and saves, ``dcp-resume`` trains to two epochs
    from that checkpoint, ``dcp-full`` trains two epochs without stopping."""
    import glob

    from lightning.pytorch.strategies import ModelParallelStrategy

    warnings.simplefilter("ignore")
    root = os.path.dirname(out)
    module = OursFsdp2()
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    ckpt = None
    if kind == "dcp-resume":
        (ckpt,) = glob.glob(os.path.join(root, "dcp-first", "checkpoints", "*.ckpt"))
    trainer, rows = _fit(
        module,
        os.path.join(root, kind),
        epochs=1 if kind == "dcp-first" else 2,
        devices=2,
        strategy=strategy,
        enable_checkpointing=True,
        ckpt_path=ckpt,
    )
    _save_whole(trainer, module, rows, None, out)


def _save_whole(trainer, module, rows, validated, out) -> None:
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
    (resume if sys.argv[1].startswith("dcp-") else main)(sys.argv[1], sys.argv[2])
    leave()  # every rank has saved: end without the interpreter's finalization (leave says why)
