"""A short soak with injected overflows, state checked on every step
(benchmarks/soak.py; the 10,000-step run is recorded in benchmarks/results/soak_cpu.md)."""

from __future__ import annotations

import os
import sys

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
)

import soak


def test_a_few_hundred_steps_with_injected_overflows_keep_every_rule():
    result = soak.run(steps=300, poison_every=20)
    assert result["problems"] == []
    assert result["skipped"] == 15  # exactly the poisoned steps
