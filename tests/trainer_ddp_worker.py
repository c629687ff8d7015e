"""Run by tests/test_trainer_transformers.py under torchrun (2 processes, gloo, CPU):

    python -m torch.distributed.run --nproc_per_node=2 tests/trainer_ddp_worker.py KIND OUT

KIND: stock (transformers.Trainer) or graphamp (graphamp's Trainer, aot_eager); the same script
otherwise, as a user switching one import would run it. Rank 0 writes the logged losses, grad
norms and learning rates and the final parameters to OUT.
"""

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transformers
from test_trainer_transformers import GraphampTrainer, _args, _gpt2, _lm_data, _train

STEPS = 6


def main(kind: str, out: str) -> None:
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    model, data = _gpt2(), _lm_data(64)
    # test_trainer_transformers' arguments, data parallel on gloo
    args = _args(os.path.dirname(out), ddp_backend="gloo", max_steps=STEPS, warmup_steps=2)
    trainer_type = GraphampTrainer if kind == "graphamp" else transformers.Trainer
    trainer, logs = _train(trainer_type, model, args, data)
    if trainer.args.process_index == 0:
        torch.save(
            {
                "world_size": trainer.args.world_size,
                "loss": [h["loss"] for h in logs],
                "grad_norm": [h["grad_norm"] for h in logs],
                "learning_rate": [h["learning_rate"] for h in logs],
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            },
            out,
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
