"""The transformers Trainer with graphamp: one changed line, the Trainer's import.

    python examples/hf_trainer.py [--tiny]

A GPT-2 from a config (no download) learns the text Python ships (pydoc's topics, one token
per byte) with the Trainer's fp16, gradient accumulation, clipping, a cosine schedule with
warmup, weight decay, logging, evaluation and checkpoints, all as the stock Trainer takes them.
"""

import os
import pydoc_data.topics as topics
import tempfile

import torch
from _common import parse
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from graphamp.integrations.transformers import Trainer  # was: from transformers import Trainer

args = parse(__doc__.splitlines()[0], steps=2000)
text = "".join(topics.topics[k] for k in sorted(topics.topics)).encode("ascii", "replace")
block = 32 if args.tiny else 256
tokens = torch.tensor(list(text[: len(text) // block * block])).view(-1, block)
blocks = [{"input_ids": t, "labels": t} for t in tokens]
train, evaluation = blocks[: -len(blocks) // 10], blocks[-len(blocks) // 10 :][:64]

size = dict(n_embd=64, n_layer=2, n_head=2) if args.tiny else dict(n_embd=512, n_layer=8, n_head=8)
model = GPT2LMHeadModel(
    GPT2Config(vocab_size=256, n_positions=block, bos_token_id=0, eos_token_id=0, **size)
)
output_dir = tempfile.TemporaryDirectory(prefix="hf_trainer_")
training_args = TrainingArguments(
    output_dir=output_dir.name,
    use_cpu=args.device.type == "cpu",
    fp16=True,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=2,
    dataloader_drop_last=True,  # accumulation in graphamp needs equal micro-batches
    max_grad_norm=1.0,
    learning_rate=1e-3,
    weight_decay=0.1,
    lr_scheduler_type="cosine",
    warmup_steps=max(1, args.steps // 10),
    max_steps=args.steps,
    logging_steps=max(1, args.steps // 4),
    eval_strategy="steps",
    eval_steps=args.steps // 2,
    save_steps=args.steps // 2,
    report_to=[],
    disable_tqdm=True,
)
trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=train,
    eval_dataset=evaluation,
    # graphamp's own options (not needed: inductor is the default backend; aot_eager compiles
    # faster on a CPU)
    configure_graph=lambda g: g.config.set_backend(args.backend),
)
trainer.train()
for row in trainer.state.log_history:
    if "loss" in row:
        print(
            f"step {row['step']}: loss {row['loss']:.3f}, grad_norm {row['grad_norm']:.3f}, "
            f"loss_scale {row['loss_scale']:g}, skipped_steps {row['skipped_steps']}"
        )
    elif "eval_loss" in row:
        print(f"step {row['step']}: eval_loss {row['eval_loss']:.3f}")
print(trainer.graph.precision_report(with_autocast=False).summary())
checkpoint = os.path.join(output_dir.name, f"checkpoint-{args.steps}")
print(f"checkpoint-{args.steps}: {', '.join(sorted(os.listdir(checkpoint)))}")
output_dir.cleanup()
