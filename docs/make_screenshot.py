"""Render a dump's report.html in headless Chromium and keep a screenshot under docs/.

    python docs/make_screenshot.py [--out docs/report.png] [--chromium /usr/bin/chromium]

Trains a small CNN with BatchNorm for two steps through a Graph (fp16, GradScaler, CPU), dumps
it, opens report.html in headless Chromium and saves a PNG showing the summary, the operator
table and the coloured graph picture. Exits non-zero if Chromium is missing or draws nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.nn as nn

import graphamp

HERE = os.path.dirname(os.path.abspath(__file__))


def make_report(path: str) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    class SmallCNN(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.loss_fn = nn.CrossEntropyLoss()
            self.add_optimizer(opt, clip_grad_max_norm=1.0)
            self.config.enable_amp(True)
            self.config.set_backend("aot_eager")
            self.set_grad_scaler(graphamp.GradScaler(init_scale=1024))

        def build(self, x, y):
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss

    g = SmallCNN()
    for _ in range(2):
        g(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))
    return os.path.join(g.dump(path), "report.html")


def screenshot(html: str, out: str, chromium: str, size: str = "1400,1900") -> None:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--hide-scrollbars",
            f"--window-size={size}",
            f"--screenshot={os.path.abspath(out)}",
            "file://" + os.path.abspath(html),
        ]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    if not os.path.exists(out) or os.path.getsize(out) < 10_000:
        raise RuntimeError(f"Chromium wrote no usable screenshot at {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "report.png"))
    parser.add_argument(
        "--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser") or ""
    )
    args = parser.parse_args()
    if not args.chromium:
        print("Chromium not found: install Debian's chromium package", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        html = make_report(os.path.join(tmp, "dump"))
        screenshot(html, args.out, args.chromium)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
