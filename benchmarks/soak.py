"""A long run with injected overflows: graphamp's state after every step checked against the rules.

A small BatchNorm MLP, AdamW with a LambdaLR scheduler, fp16 AMP with graphamp's GradScaler
(torch's semantics: no floor, no cap), batches poisoned with inf at a fixed rate. After every
step it checks, on the host:

- a skipped step left every parameter, every optimizer state tensor and the BatchNorm
  statistics bitwise unchanged;
- the loss scale equals torch.amp.GradScaler's update rule fed the same overflow flags;
- the graph's step counter, the optimizer's per-parameter ``step`` and the scheduler agree
  (AdamW's step counts applied updates only, so it trails by the number of skips);

and it records the process's resident memory every 500 steps (flat means no leak).

    python benchmarks/soak.py --steps 10000          # the long soak (results/soak_cpu.md)
    python benchmarks/soak.py --steps 300            # what tests/test_soak.py runs
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphamp

GROWTH_INTERVAL = 10


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8))


class SoakGraph(graphamp.Graph):
    def __init__(self, model, opt, sch, backend):
        super().__init__()
        self.model = model
        self.add_optimizer(opt, lr_sch=sch)
        self.config.enable_amp(True)
        self.config.set_backend(backend)
        # growth every 10 clean steps, a poisoned batch every 20: the scale moves up and down
        # around 2**12 for ever (with growth every 20 it would halve for ever and reach 0)
        self.set_grad_scaler(
            graphamp.GradScaler(
                init_scale=2.0**12,
                growth_interval=GROWTH_INTERVAL,
                min_scale=0.0,
                max_scale=math.inf,
            )
        )

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _state(model, opt) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for s in opt.state.values():
        tensors += [v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensors


def _torch_scale_rule(scale: float, tracker: int, found: bool, growth_interval: int):
    """torch._amp_update_scale_'s rule (growth 2, backoff 0.5)."""
    if found:
        return scale * 0.5, 0
    tracker += 1
    if tracker == growth_interval:
        return scale * 2.0, 0
    return scale, tracker


def run(steps: int, poison_every: int = 20, backend: str = "aot_eager", seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s / 1000))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = SoakGraph(model, opt, sch, backend)
    gen = torch.Generator().manual_seed(seed)
    scale, tracker, skipped, problems, memory = 2.0**12, 0, 0, [], []
    start = time.perf_counter()
    for step in range(steps):
        x = torch.randn(32, 32, generator=gen)
        poisoned = step % poison_every == poison_every // 2
        if poisoned:
            x[0, 0] = float("inf")
        before = _state(model, opt) if poisoned else None
        g(x, torch.randint(0, 8, (32,), generator=gen))
        found = bool(g.grad_scaler.found_inf.item())
        skipped += found
        if found != poisoned:
            problems.append(f"step {step}: skipped={found}, poisoned={poisoned}")
        if poisoned and not all(torch.equal(a, b) for a, b in zip(before, _state(model, opt))):
            problems.append(f"step {step}: a skipped step changed the state")
        scale, tracker = _torch_scale_rule(scale, tracker, found, GROWTH_INTERVAL)
        if g.grad_scaler.get_scale() != scale:
            problems.append(f"step {step}: scale {g.grad_scaler.get_scale()} != torch's {scale}")
        adam_steps = {float(s["step"]) for s in opt.state.values()}
        if (
            g.step_count != step + 1
            or sch.last_epoch != step + 1
            or adam_steps != {float(step + 1 - skipped)}
        ):
            problems.append(
                f"step {step}: counters graph {g.step_count}, scheduler "
                f"{sch.last_epoch}, adam {sorted(adam_steps)}"
            )
        if step % 500 == 0:
            memory.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
        if len(problems) > 20:
            break
    return {
        "steps": steps,
        "skipped": skipped,
        "poison_every": poison_every,
        "problems": problems,
        "max_rss_mib_every_500": memory,
        "backend": backend,
        "seconds": round(time.perf_counter() - start, 1),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--backend", default="aot_eager", choices=graphamp.config.BACKENDS)
    args = parser.parse_args()
    print(json.dumps(run(args.steps, backend=args.backend), indent=1))


if __name__ == "__main__":
    main()
