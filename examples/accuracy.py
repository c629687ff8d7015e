"""Does mixed precision through graphamp reach fp32's accuracy on real data? Two tasks, six
runs each (fp32, fp16 + GradScaler, bf16, and bf16 with fp8 matmuls by the tensorwise, rowwise
and delayed recipes; fp8 is held to bf16), same seed, same steps:

- a character-level language model (a 2-layer transformer) on the text Python ships in
  ``pydoc_data.topics``: validation loss (nats per character) on the last 10% of the text;
- a small CNN with BatchNorm on scikit-learn's handwritten digits (8x8 images shipped with the
  package): test accuracy and loss on a held-out 20%.

Each trained model is evaluated in fp32 (the weights' quality, not the evaluation's precision).

    python examples/accuracy.py            # full size (about half an hour on 2 CPU cores:
                                           # fp16 matrix products are slow on CPUs)
    python examples/accuracy.py --tiny     # under a minute, for the tests
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphamp

# name -> (AMP dtype, fp8 recipe); fp8 runs keep every linear layer whose sizes allow it in fp8
RUNS = {
    "fp32": (None, None),
    "fp16": (torch.float16, None),
    "bf16": (torch.bfloat16, None),
    "fp8": (torch.bfloat16, "tensorwise"),
    "fp8_rowwise": (torch.bfloat16, "rowwise"),
    "fp8_delayed": (torch.bfloat16, "delayed"),
}
BASELINE = {
    "fp16": "fp32",
    "bf16": "fp32",
    "fp8": "bf16",
    "fp8_rowwise": "bf16",
    "fp8_delayed": "bf16",
}


# -- character-level language model ---------------------------------------------------------------


def load_text():
    import pydoc_data.topics as topics

    text = "".join(topics.topics[k] for k in sorted(topics.topics))
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(len(data) * 0.9)
    return data[:split], data[split:], len(chars)


class CharBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.qkv(self.ln1(x)).split(c, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharLM(nn.Module):
    def __init__(self, vocab, dim=128, heads=4, layers=2, seq=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*(CharBlock(dim, heads) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def lm_batch(data, gen, batch, seq):
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
    x = torch.stack([data[s : s + seq] for s in starts])
    y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
    return x, y


def train_char_lm(run, steps, seed=0, batch=32, seq=64, dim=128):
    train, val, vocab = load_text()
    torch.manual_seed(seed)
    model = CharLM(vocab, dim=dim, seq=seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    g = _graph(
        model,
        opt,
        sch,
        run,
        lambda m, x, y: F.cross_entropy(m(x).reshape(-1, vocab), y.reshape(-1)),
    )
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        g(*lm_batch(train, gen, batch, seq))
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
            for x, y in (lm_batch(val, gen, 64, seq) for _ in range(20))
        ]
    return {
        "val_loss": float(torch.stack(losses).mean()),
        "skipped": int(sum(g.history.fetch()["skipped"])),
    }


# -- digits ---------------------------------------------------------------------------------------


def load_digits():
    from sklearn.datasets import load_digits as sk_digits

    digits = sk_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    split = int(len(y) * 0.8)
    return (x[:split], y[:split]), (x[split:], y[split:])


def digits_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 16, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def train_digits(run, epochs, seed=0, batch=64):
    (xtr, ytr), (xte, yte) = load_digits()
    torch.manual_seed(seed)
    model = digits_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    steps = epochs * (len(ytr) // batch)
    sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    g = _graph(model, opt, sch, run, lambda m, x, y: F.cross_entropy(m(x), y))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(ytr), generator=gen)
        for i in range(len(ytr) // batch):
            idx = perm[i * batch : (i + 1) * batch]
            g(xtr[idx], ytr[idx])
    model.eval()
    with torch.no_grad():
        logits = model(xte)
    return {
        "test_accuracy": float((logits.argmax(1) == yte).float().mean()),
        "test_loss": float(F.cross_entropy(logits, yte)),
        "skipped": int(sum(g.history.fetch()["skipped"])),
    }


def _graph(model, opt, sch, run, loss_of):
    dtype, fp8 = RUNS[run]

    class Train(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt, lr_sch=sch)
            self.config.set_backend("aot_eager")
            if dtype is not None:
                self.config.enable_amp(True, dtype=dtype)
            if dtype == torch.float16:
                self.set_grad_scaler(graphamp.GradScaler())
            if fp8 is not None:
                self.config.enable_fp8(True, recipe=fp8, keep_first_last=False)

        def build(self, x, y):
            loss = loss_of(self.model, x, y)
            loss.backward()
            return loss

    return Train()


def run(tiny: bool, runs=tuple(RUNS)) -> dict:
    lm_steps, epochs = (12, 5) if tiny else (500, 20)
    lm_kwargs = {"batch": 8, "seq": 32, "dim": 64} if tiny else {}
    results = {"char_lm": {}, "digits": {}, "steps": {"char_lm": lm_steps, "digits_epochs": epochs}}
    for name in runs:
        start = time.perf_counter()
        results["char_lm"][name] = train_char_lm(name, lm_steps, **lm_kwargs)
        results["digits"][name] = train_digits(name, epochs)
        print(
            f"{name}: char LM {results['char_lm'][name]}, digits {results['digits'][name]} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    for task, metric in (
        ("char_lm", "val_loss"),
        ("digits", "test_accuracy"),
        ("digits", "test_loss"),
    ):
        for name, baseline in BASELINE.items():
            if name in results[task] and baseline in results[task]:
                base = results[task][baseline][metric]
                value = results[task][name][metric]
                results[task][name][f"{metric}_rel_diff"] = (value - base) / base
    return results


def table(results: dict) -> str:
    lm, dg = results["char_lm"], results["digits"]
    lines = [
        "| run | char LM val loss (nats/char) | vs baseline | digits test accuracy | vs baseline | "
        "digits test loss | skipped steps (LM, digits) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name in lm:

        def rel(task, m):
            key = m + "_rel_diff"
            value = results[task][name].get(key)
            return "" if value is None else f"{value:+.2%} ({BASELINE[name]})"

        lines.append(
            f"| {name} | {lm[name]['val_loss']:.4f} | {rel('char_lm', 'val_loss')} | "
            f"{dg[name]['test_accuracy']:.4f} | {rel('digits', 'test_accuracy')} | "
            f"{dg[name]['test_loss']:.4f} | {lm[name]['skipped']}, {dg[name]['skipped']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None, help="write JSON and markdown results here")
    parser.add_argument(
        "--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="which runs (default all)"
    )
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    results = run(args.tiny, tuple(args.runs))
    text = table(results)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(results, f, indent=2)
        runs = "" if args.runs == list(RUNS) else " --runs " + " ".join(args.runs)
        with open(args.out + ".md", "w") as f:
            f.write(
                f"# Accuracy: fp16 and bf16 against fp32, fp8 against bf16\n\nCPU, torch "
                f"{torch.__version__}, `python examples/accuracy.py{runs} --out {args.out}`; "
                "char LM "
                f"{results['steps']['char_lm']} steps, digits "
                f"{results['steps']['digits_epochs']} epochs.\n\n{text}\n"
            )


if __name__ == "__main__":
    main()
