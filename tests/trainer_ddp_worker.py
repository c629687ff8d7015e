"""Run by tests/test_trainer_transformers.py under torchrun (2 processes, gloo, CPU):

    python -m torch.distributed.run --nproc_per_node=2 tests/trainer_ddp_worker.py KIND OUT

KIND: stock (transformers.Trainer) or graphamp (graphamp's Trainer, aot_eager); the same script
otherwise, as a user switching one import would run it. graphamp-full_shard and
graphamp-shard_grad_op add TrainingArguments(fsdp=...) (graphamp's ZeRO-3 and ZeRO-2) and save
a checkpoint every 3 steps. Rank 0 writes the logged losses, grad norms and learning rates and
the final (whole) parameters to OUT.
"""

import os
import sys
import warnings

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transformers
from dist_worker import leave
from test_trainer_transformers import GraphampTrainer, _args, _gpt2, _lm_data, _train

STEPS = 6


def main(kind: str, out: str) -> None:
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    model, data = _gpt2(), _lm_data(64)
    # test_trainer_transformers' arguments, data parallel on gloo
    fsdp = kind.split("-")[1] if "-" in kind else ""
    extra = (
        dict(fsdp=fsdp, save_strategy=os.environ.get("SAVE", "steps"), save_steps=3) if fsdp else {}
    )
    args = _args(os.path.dirname(out), ddp_backend="gloo", max_steps=STEPS, warmup_steps=2, **extra)
    trainer_type = GraphampTrainer if kind.startswith("graphamp") else transformers.Trainer
    trainer, logs = _train(trainer_type, model, args, data)
    # whole parameters on every rank (ZeRO-3's shards are gathered: a collective)
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    held = sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())
    if trainer.args.process_index == 0:
        torch.save(
            {
                "world_size": trainer.args.world_size,
                "loss": [h["loss"] for h in logs],
                "grad_norm": [h["grad_norm"] for h in logs],
                "learning_rate": [h["learning_rate"] for h in logs],
                "params": {n: whole[n].detach().clone() for n, _ in model.named_parameters()},
                "held": held,
                "zero_stage": getattr(trainer, "zero_stage", 0),
            },
            out,
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    leave()  # every rank has saved: end without the interpreter's finalization (leave says why)
