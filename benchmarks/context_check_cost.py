"""What issue 22's per-call checks cost: the call_overhead graph timed with the checks (ambient
modes, the modes and hooks in the cache key, the optimizer-state identity check) and with them
replaced by no-ops, interleaved in one process so that a shared machine's load cancels out.

    python benchmarks/context_check_cost.py

Prints one line: best-of-30 microseconds per call each way, and the difference.
"""

from __future__ import annotations

import timeit

import torch
from call_overhead import make_graph, replace_compiled_step_with_noop

from graphamp.runtime import ambient


def main() -> float:
    g = make_graph()
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
    replace_compiled_step_with_noop(g, x, y)
    runner = next(iter(g._programs.values())).runner  # a benchmark of internals
    key = g._run.structure
    real = (
        ambient.neutral_modes,
        ambient.mode_key,
        runner._optimizer_state_edited,
        key._hook_dicts,
    )
    modes = ambient.mode_key()
    no_ops = (lambda: None, lambda: modes, lambda: False, [])

    def use(checks):
        ambient.neutral_modes, ambient.mode_key, runner._optimizer_state_edited, key._hook_dicts = (
            checks
        )

    best = {"with checks": 1e9, "no-ops": 1e9}
    for _ in range(30):
        for name, checks in (("with checks", real), ("no-ops", no_ops)):
            use(checks)
            g(x, y)
            best[name] = min(best[name], timeit.timeit(lambda: g(x, y), number=2000) / 2000 * 1e6)
    use(real)
    diff = best["with checks"] - best["no-ops"]
    print(
        f"with checks {best['with checks']:.2f} us/call, checks as no-ops "
        f"{best['no-ops']:.2f} us/call, difference {diff:.2f} us (best of 30 x 2000 calls)"
    )
    return diff


if __name__ == "__main__":
    main()
