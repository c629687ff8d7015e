"""graphamp against eager on generated programs that read and write Python state
(``state_fuzz.py``): 200 cases in the default lane, 1,000 more in the slow lane (2,000 more
took 18 core-minutes and helped push CI past its limit). Each case is reproduced by its seed
(the failure shows the generated module and the schedule); ``GRAPHAMP_FUZZ_CASES=N`` runs
``N`` more cases in the slow lane, in blocks of 50, for a longer search.

The fuzzer is itself tested: with one of graphamp's mechanisms switched off (a function's
defaults not guarded, an optimizer's Python step count traced, lifting that blames every
lifted value), it must fail on the cases that need that mechanism.
"""

from __future__ import annotations

import contextvars
import os
import random

import pytest
import state_fuzz

import graphamp.capture.reads as reads
import graphamp.capture.scope_reads as scope_reads
import graphamp.step.closure_trial as closure_trial
from graphamp.runtime.lifting import Lifting

_BLOCK = 50


def _run_seeds(seeds, directory) -> list[str]:
    failures = []
    for seed in seeds:
        try:
            state_fuzz.run_case(seed, str(directory))
        except AssertionError as e:
            failures.append(f"--- seed {seed} ---\n{e}")
    return failures


@pytest.mark.parametrize("block", range(4))
def test_generated_programs_train_as_eager(block, tmp_path):
    failures = _run_seeds(range(block * _BLOCK, (block + 1) * _BLOCK), tmp_path)
    assert not failures, f"{len(failures)} of {_BLOCK} cases differ:\n" + "\n".join(failures)


# the slow lane's blocks: 1,000 cases, or GRAPHAMP_FUZZ_CASES of them
_SLOW_BLOCKS = range(4, 4 + int(os.environ.get("GRAPHAMP_FUZZ_CASES", 1000)) // _BLOCK)


@pytest.mark.slow
@pytest.mark.parametrize("block", _SLOW_BLOCKS)
def test_more_generated_programs_train_as_eager(block, tmp_path):
    failures = _run_seeds(range(block * _BLOCK, (block + 1) * _BLOCK), tmp_path)
    assert not failures, f"{len(failures)} of {_BLOCK} cases differ:\n" + "\n".join(failures)


def test_every_source_and_optimizer_is_generated_in_the_default_lane():
    """The default lane's 200 cases cover every kind of source, every optimizer, changes
    before the first call and after it."""
    cases = [state_fuzz.make_case(seed) for seed in range(4 * _BLOCK)]
    kinds = {s.kind.split(" (")[0].split(" of ")[0] for c in cases for s in c.sources}
    made = {make(0, random.Random(0)).kind for make in state_fuzz.SOURCES}
    assert {k.split(" (")[0].split(" of ")[0] for k in made} <= kinds
    assert {c.optimizer for c in cases} == set(state_fuzz.OPTIMIZERS)
    assert any(c.schedule[0] for c in cases) and any(any(c.schedule[1:]) for c in cases)


def _seeds_with(kinds: set[str], optimizer: str | None = None, count: int = 4) -> list[int]:
    """The first seeds whose cases hold every source kind in ``kinds`` (and ``optimizer``)."""
    found = []
    for seed in range(5000):
        case = state_fuzz.make_case(seed)
        held = {s.kind for s in case.sources}
        changed = any(case.schedule[1:])
        if kinds <= held and changed and optimizer in (None, case.optimizer):
            found.append(seed)
            if len(found) == count:
                break
    return found


def test_the_fuzzer_finds_a_function_default_left_unguarded(monkeypatch, tmp_path):
    monkeypatch.setattr(reads, "code_settings", lambda value, label: [])
    monkeypatch.setattr(scope_reads, "code_settings", lambda value, label: [])
    assert _run_seeds(_seeds_with({"function default"}), tmp_path)


def test_the_fuzzer_finds_an_optimizers_python_step_count_traced(monkeypatch, tmp_path):
    monkeypatch.setattr(closure_trial, "trial_step", lambda optimizer: None)
    seeds = _seeds_with(set(), optimizer="Python counts in groups")
    assert _run_seeds(seeds, tmp_path)


def test_the_fuzzer_finds_an_annealed_float_demoted_by_an_unrelated_change(monkeypatch, tmp_path):
    def blame_all(self, named=None):
        blamed = list(self.lifted)
        self.unliftable.update(blamed)
        self.lifted.clear()
        return blamed

    monkeypatch.setattr(Lifting, "blame", blame_all)
    kinds = {"float annealed before every call", "float an op needs as a Python number"}
    assert _run_seeds(_seeds_with(kinds, count=6), tmp_path)


def test_the_fuzzer_finds_a_library_objects_attributes_unwatched(monkeypatch, tmp_path):
    monkeypatch.setattr(reads, "is_library_object", lambda value: False)  # scope_reads' too
    for kind in (
        "attribute of a library's object (a scheduler's, here a logging.Formatter's)",
        "property of a library's object (logging.Handler.name)",
    ):
        assert _run_seeds(_seeds_with({kind}), tmp_path), kind


def test_the_fuzzer_finds_a_param_group_entry_build_reads_unrecorded(monkeypatch, tmp_path):
    monkeypatch.setattr(reads, "view_param_groups", lambda *args: None)
    assert _run_seeds(
        _seeds_with({"optimizer's lr read by build() off its param groups"}), tmp_path
    )


def test_the_fuzzer_finds_a_schedulers_last_lr_unrecorded(monkeypatch, tmp_path):
    monkeypatch.setattr(reads, "_recorded_last_lrs", lambda scheduler, lrs, frame: lrs)
    monkeypatch.setattr(reads, "_LAST_LRS", reads.last_lrs_patch(reads._recorded_last_lrs))
    assert _run_seeds(_seeds_with({"LR scheduler's get_last_lr() read by build()"}), tmp_path)


def test_the_fuzzer_finds_a_context_variables_value_unrecorded(monkeypatch, tmp_path):
    original = reads.code_settings

    def without_context_values(value, label):
        return [] if isinstance(value, contextvars.ContextVar) else original(value, label)

    monkeypatch.setattr(scope_reads, "code_settings", without_context_values)
    assert _run_seeds(_seeds_with({"value of a contextvars.ContextVar"}), tmp_path)
