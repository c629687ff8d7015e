"""What each choice of docs/choosing.md costs: precision (fp32, fp16 + scaler, bf16) by backend
(eager, aot_eager, inductor cold, inductor on a restart), for the README's MLP.

The README's Use block (Linear 256->128, ReLU, Linear 128->10, batch 128, SGD with momentum),
on the CPU unless ``--device cuda``. Every cell runs in a fresh Python process: its first call
(the Graph's construction excluded: capture, AMP passes, assembly, compile) and its steady
step (the mean of 200 calls after it). "cold" starts on an empty inductor cache directory
and graphamp step cache; "restart" is a second process on the directories the cold one filled.

    python benchmarks/choices.py                 # the table of docs/choosing.md
    python benchmarks/choices.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CELL = r"""
import json, sys, time, torch, torch.nn as nn
import graphamp
backend, precision, device = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]

class TrainGraph(graphamp.Graph):
    def __init__(self):
        super().__init__()
        self.model = model
        self.loss_fn = nn.CrossEntropyLoss()
        self.add_optimizer(opt)
        if dtype is not None:
            self.config.enable_amp(True, dtype=dtype)
        if dtype == torch.float16:
            self.set_grad_scaler(graphamp.GradScaler(init_scale=3000))
        self.config.set_backend(backend)
        self.config.set_progress(False)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss

g = TrainGraph()
x = torch.randn(128, 256, device=device)
y = torch.randint(0, 10, (128,), device=device)
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
t = time.perf_counter(); g(x, y); sync(); first = time.perf_counter() - t
t = time.perf_counter()
for _ in range(200):
    g(x, y)
sync()
print(json.dumps({"first_s": first, "step_ms": (time.perf_counter() - t) / 200 * 1e3}))
"""


def _cell(backend: str, precision: str, device: str, env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CELL, backend, precision, device],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    rows = []
    for precision in ("fp32", "fp16", "bf16"):
        with tempfile.TemporaryDirectory() as caches:
            # graphamp's step cache lives in inductor's cache directory
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor")}
            cells = {b: _cell(b, precision, args.device, env) for b in ("eager", "aot_eager")}
            cells["inductor cold"] = _cell("inductor", precision, args.device, env)
            cells["inductor restart"] = _cell("inductor", precision, args.device, env)
        rows.append((precision, cells))
    columns = ("eager", "aot_eager", "inductor cold", "inductor restart")
    print("| precision | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for precision, cells in rows:
        shown = [f"{c['first_s']:.2f} s, {c['step_ms']:.3f} ms" for c in cells.values()]
        print(f"| {precision} | " + " | ".join(shown) + " |")


if __name__ == "__main__":
    main()
