"""Which op overflowed, and healing it without a restart: T5 with large feed-forward weights.

T5 checkpoints are the classic fp16 failure: the feed-forward output layers (``wo``) produce
values beyond 65,504, every step overflows, the loss scaler backs off forever and eager
autocast + GradScaler never trains. (transformers marks ``wo`` in ``_keep_in_fp32_modules`` for
this reason; the example clears it to show the overflow being found.) With
``enable_overflow_tracing`` graphamp says which op made the first inf and on which line; with
``enable_amp_autofix`` it pins that op to fp32 and training goes on, in the same process.

    python examples/overflow_forensics.py [--tiny]
"""

import copy
import os
import tempfile

import torch
from _common import parse
from transformers import T5Config, T5ForConditionalGeneration

import graphamp

args = parse(__doc__.splitlines()[0], steps=40)
if args.tiny:  # two pins at after=2 need four skipped steps; a few more show training go on
    args.steps = max(args.steps, 10)
if args.tiny:
    config = T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    batch, length = 2, 8
else:  # t5-small's shape, random weights (no download)
    config = T5Config(
        vocab_size=32128,
        d_model=512,
        d_kv=64,
        d_ff=2048,
        num_layers=6,
        num_heads=8,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    batch, length = 16, 128
torch.manual_seed(0)
model = T5ForConditionalGeneration(config).to(args.device)
model._keep_in_fp32_modules = None  # let the overflow happen: graphamp is to find it
with torch.no_grad():
    for name, module in model.named_modules():
        if name.endswith("DenseReluDense.wo"):
            module.weight.mul_(1e5 if args.tiny else 2e3)
ids = torch.randint(1, config.vocab_size, (batch, length), device=args.device)
labels = torch.randint(1, config.vocab_size, (batch, length), device=args.device)
eager_model = copy.deepcopy(model)


class T5Train(graphamp.Graph):
    def __init__(self):
        super().__init__()
        self.model = model
        self.add_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
        self.config.enable_amp(True)  # fp16
        self.config.set_backend(args.backend)
        self.set_grad_scaler(graphamp.GradScaler())
        self.config.enable_amp_autofix(max_pins=4, after=2)  # turns overflow tracing on

    def build(self, ids, labels):
        loss = self.model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss


train = T5Train()
for _ in range(args.steps):
    train(ids, labels)
history = train.history.fetch()
print(train.overflow_report())
print("\npins:", *(f"{p.describe()}  [{p.reason}]" for p in train.config.amp_pins), sep="\n  ")
print("\n" + "\n".join(str(train.range_report()).splitlines()[:7]))
print(
    f"\ngraphamp: skipped {int(sum(history['skipped']))}/{len(history['skipped'])} steps, "
    f"loss {history['loss'][-1]:.3f} at the end"
)

# the same model, batch and optimizer in eager autocast + torch.amp.GradScaler
optimizer = torch.optim.AdamW(eager_model.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler(args.device.type)
eager_skipped = 0
for _ in range(args.steps):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(args.device.type, dtype=torch.float16):
        loss = eager_model(input_ids=ids, labels=labels).loss
    scaler.scale(loss).backward()
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    eager_skipped += scaler.get_scale() < before
print(f"eager autocast + GradScaler: skipped {eager_skipped}/{args.steps} steps")

# a resumed run keeps the pins: they are in the graph's state dict
path = os.path.join(tempfile.mkdtemp(), "graph.pt")
torch.save(train.state_dict(), path)
print(
    f"saved {len(torch.load(path, weights_only=True)['amp_pins'])} pins with the graph state "
    f"({path}); `python -m graphamp plot {path} --headroom` draws the headroom"
)
