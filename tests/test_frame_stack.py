"""Builds run on a roomy frame stack (torchkit/frame_stack.py): CPython maps a chunk of frame
memory per call where a hot call sits on a chunk's edge; under ``on_roomy_stack`` it does not."""

from __future__ import annotations

import resource
import sys
import types

import pytest
import torch
import torch.nn as nn

import graphamp
from graphamp.torchkit import frame_stack
from graphamp.torchkit.frame_stack import on_roomy_stack

CALLS = 200


def _leaf(x):
    return x + 1


def _hot_loop(n):
    for i in range(n):
        _leaf(i)


def _from_frame(fn, n):
    return fn(n)


# the hot loop called from frames one slot larger each time, over more than a chunk's 2,048
# slots: at some size the loop's calls to _leaf start a new chunk, and each one maps it again
_PADDED = [
    types.FunctionType(
        _from_frame.__code__.replace(co_stacksize=_from_frame.__code__.co_stacksize + extra),
        globals(),
    )
    for extra in range(0, 2200, 3)
]


def _worst_page_faults() -> int:
    """The most page faults one run of the hot loop took, over every frame alignment."""
    worst = 0
    for call in _PADDED:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        call(_hot_loop, CALLS)
        worst = max(worst, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return worst


def test_a_hot_call_on_a_chunk_edge_maps_memory_per_call_and_not_on_the_roomy_stack():
    plain = _worst_page_faults()
    if plain < CALLS // 2:
        pytest.skip(
            f"this interpreter ({sys.implementation.name} {sys.version.split()[0]}) took at most "
            f"{plain} page faults for {CALLS} calls at any alignment: it does not map frame "
            "memory per call, so there is nothing for the roomy stack to remove"
        )
    roomy = on_roomy_stack(_worst_page_faults)
    assert roomy < CALLS // 10, (plain, roomy)


def test_the_roomy_call_passes_arguments_results_and_exceptions_through():
    assert on_roomy_stack(lambda a, b=0: a * 10 + b, 4, b=2) == 42
    with pytest.raises(KeyError, match="missing"):
        on_roomy_stack({}.__getitem__, "missing")
    # what it declares: a frame too large for any chunk in use (the module's docstring)
    assert frame_stack._call.__code__.co_stacksize >= frame_stack._SLOTS


def test_a_build_runs_on_the_roomy_stack():
    seen = []

    class Step(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = nn.Linear(4, 2)
            self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))
            self.config.set_backend("eager")
            self.config.set_step_cache(False)

        def build(self, x):
            frame = sys._getframe()
            while frame is not None and frame.f_code is not frame_stack._call.__code__:
                frame = frame.f_back
            seen.append(frame is not None)
            loss = self.model(x).square().mean()
            loss.backward()
            return loss

    Step()(torch.randn(3, 4))
    assert seen and all(seen)
