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
from models import tiny_gpt2

STEPS = 6


def main(kind: str, out: str) -> None:
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = tiny_gpt2(bos_token_id=0, eos_token_id=0)
    tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = transformers.TrainingArguments(
        output_dir=os.path.dirname(out),
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-3,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        seed=0,
        disable_tqdm=True,
    )
    if kind == "graphamp":
        from graphamp.integrations.transformers import Trainer

        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=data,
            configure_graph=lambda g: g.config.set_backend("aot_eager"),
        )
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
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
