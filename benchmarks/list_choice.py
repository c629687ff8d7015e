"""Should softmax, log_softmax and layer_norm be deny (torch.autocast) or infer (OneFlow)?

Trains one step of two transformer LMs through a Graph with each choice and measures, against a
float64 reference of the same step: the loss error and the gradient error (relative L2 over all
parameters), plus the casts in the forward. Models: a pre-LayerNorm GPT block stack (where the
residual stream stays fp32 either way) and a post-LayerNorm (BERT-style) stack with attention
written out (softmax in the graph), where infer lets the residual stream run in low precision.

    python benchmarks/list_choice.py [--device cpu|cuda] [--dtype fp16 bf16] [--steps 20]

Writes benchmarks/results/list_choice.json and .md. On CUDA it also times a step of each.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from models import ManualAttentionBlock, TinyGPT, lm_loss

import graphamp

HERE = os.path.dirname(os.path.abspath(__file__))
ONEFLOW_INFER = ["aten._softmax", "aten._log_softmax", "aten.native_layer_norm"]


class PostLNBlock(ManualAttentionBlock):
    """BERT-style: LayerNorm after each residual add."""

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            lin(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for lin in (self.q, self.k, self.v)
        )
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        y = att.softmax(dim=-1) @ v
        x = self.ln1(x + self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return self.ln2(x + self.out(F.gelu(self.fc(x))))


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    block = PostLNBlock if kind == "post_ln" else None
    kwargs = dict(vocab=512, dim=256, heads=4, layers=4, seq=128)
    return TinyGPT(block=block, **kwargs) if block else TinyGPT(**kwargs)


def reference(model, x, y):
    ref = copy.deepcopy(model).double()
    loss = lm_loss(ref(x), y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def graphamp_step(model, x, y, dtype, infer: bool, device):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    class G(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_amp(True, dtype=dtype)
            self.config.set_backend("inductor" if device.type == "cuda" else "aot_eager")
            if dtype == torch.float16:
                self.set_grad_scaler(graphamp.StaticGradScaler(1024.0))
            if infer:
                self.config.override_amp_lists(infer=ONEFLOW_INFER)

        def build(self, x, y):
            loss = lm_loss(self.model(x), y)
            loss.backward()
            return loss

    g = G()
    loss = g(x, y).item()
    grads = {n: (before[n] - p.detach()).double() for n, p in model.named_parameters()}
    report = g.precision_report(with_autocast=False)
    timing = None
    if device.type == "cuda":
        opt.param_groups[0]["lr"] = 0.0
        for _ in range(5):
            g(x, y)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            g(x, y)
        torch.cuda.synchronize()
        timing = (time.perf_counter() - start) / 50 * 1e3
    return loss, grads, report, timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", nargs="*", default=["fp16", "bf16"])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    device = torch.device(args.device)
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    rows = []
    for kind in ("pre_ln", "post_ln"):
        model = make_model(kind).to(device)
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, 512, (8, 129), generator=g).to(device)
        x, y = idx[:, :-1], idx[:, 1:]
        ref_loss, ref_grads = reference(model, x, y)
        norm = math.sqrt(sum(float(v.pow(2).sum()) for v in ref_grads.values()))
        for name in args.dtype:
            for infer in (False, True):
                loss, grads, report, ms = graphamp_step(model, x, y, dtypes[name], infer, device)
                err = (
                    math.sqrt(sum(float((grads[n] - ref_grads[n]).pow(2).sum()) for n in ref_grads))
                    / norm
                )
                rows.append(
                    {
                        "model": kind,
                        "dtype": name,
                        "choice": "infer (OneFlow)" if infer else "deny (autocast)",
                        "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
                        "grad_rel_err": err,
                        "casts": report.casts,
                        "ops_low": report.ops_low,
                        "ops": report.ops_total,
                        "ms": ms,
                    }
                )
                print(rows[-1])
    meta = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "command": f"python benchmarks/list_choice.py --device {args.device} --dtype "
        + " ".join(args.dtype),
    }
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if device.type == "cpu" else "_cuda"
    with open(os.path.join(args.out, f"list_choice{suffix}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = [
        "# softmax / log_softmax / layer_norm: deny (autocast) or infer (OneFlow)",
        "",
        f"{meta['device']}, torch {meta['torch']}. Command: `{meta['command']}`. One step "
        "of a 4-layer, 256-wide LM (batch 8, sequence 128) against a float64 reference.",
        "",
        "| model | dtype | choice | loss rel. error | grad rel. error | casts | ops low/total | ms/step |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = f"{r['ms']:.2f}" if r["ms"] is not None else "-"
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['choice']} | {r['loss_rel_err']:.2e} | "
            f"{r['grad_rel_err']:.2e} | {r['casts']} | {r['ops_low']}/{r['ops']} | {ms} |"
        )
    with open(os.path.join(args.out, f"list_choice{suffix}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
