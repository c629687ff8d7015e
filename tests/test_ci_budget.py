"""CI's time budget (tests/conftest.py): with GRAPHAMP_TESTS_STOP_AT passed, a test is skipped
with a reason that names the budget, so .ci/run can count what it left; unset, nothing is."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_test_that_only_passes():
    """What the check below runs in a child pytest."""


def _child(stop_at: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GRAPHAMP_TESTS_STOP_AT"}
    if stop_at is not None:
        env["GRAPHAMP_TESTS_STOP_AT"] = stop_at
    test = f"{os.path.join(HERE, 'test_ci_budget.py')}::test_a_test_that_only_passes"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.stdout


def test_a_spent_budget_skips_with_the_reason_ci_counts_and_no_budget_runs_everything():
    spent = _child("1")  # a Unix time long past
    assert "1 skipped" in spent and "SKIPPED [1]" in spent, spent
    assert "time budget" in spent, spent  # the words .ci/run's count looks for
    assert "1 passed" in _child(None)
    assert "1 passed" in _child(str(2**40))  # far in the future
