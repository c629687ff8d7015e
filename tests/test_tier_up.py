"""The chosen step compiled beside training, taking over when ready (``pipeline/tier_up.py``).

The model is a stack of small transformer blocks on float inputs (no embedding: see
``test_outline._BlockStack``). The take-over, whenever it happens, must leave training bitwise
as the outlined step up to it and the inlined step from it train in one process: the two steps'
kernels are fused differently, and on a CPU without AVX512 (AVX2 only) the two trained apart
after 8 steps (a layer norm's weight), so only the hand-over itself can be bitwise.
"""

from __future__ import annotations

import logging
import math
import re
import time

import pytest
import torch
import torch.nn as nn
from helpers import assert_bitwise, make_graph
from models import Block

from graphamp.pipeline import side_compile, tier_up

pytestmark = pytest.mark.inductor

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
WAIT_S = 300.0  # the longest a test trains on while the child compiles


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(Block(32, 4) for _ in range(3))
        self.head = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 10))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(out, y):
    return nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten())


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(2, 8, 8, generator=gen), torch.randint(0, 10, (2, 8), generator=gen))
        for _ in range(n)
    ]


def _graph(configure=None):
    torch.manual_seed(0)
    model = _Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = make_graph(model, _loss, opt, backend="inductor", amp=torch.bfloat16, configure=configure)
    return g, model, opt


def _outlined(g) -> bool:
    graph = g.compiled_steps[-1].step_graph.graph
    return any(n.target is INVOKE_SUBGRAPH for n in graph.nodes)


def _program(g):
    return g._programs.last()


@pytest.fixture
def beside(monkeypatch):
    """The side compile on (as on a machine of two or more cores), the child asked for the
    chosen step from the first call on."""
    monkeypatch.setenv("GRAPHAMP_SIDE_COMPILE", "1")
    monkeypatch.setattr(side_compile, "_cores", lambda: 2)
    monkeypatch.setattr(tier_up, "AFTER_CALLS", 1)
    monkeypatch.setattr(tier_up, "TRAINED_PER_BUILT", 0.0)


def _train_until_taken_over(g, batches) -> int:
    """Train until the program has no pending take-over; the number of calls made."""
    calls, start = 0, time.monotonic()
    while True:
        g(*batches[calls])
        calls += 1
        if _program(g).tier_up is None and calls > 1:
            return calls
        assert time.monotonic() - start < WAIT_S, "the child did not finish"
        time.sleep(0.05)


def _assert_trains_as_the_steps_it_ran(model, batches, log_text: str) -> None:
    """``model``'s state is bitwise what the outlined step (with block updates, the first one
    compiled) makes of the batches before the take-over's call and the inlined step of the
    rest, both built in this process: the hand-over changes nothing."""
    at = int(re.search(r"takes over at call (\d+)", log_text).group(1))
    first, alone, opt = _graph(
        lambda g: (g.config.set_outline_blocks(True), g.config.set_block_updates(True))
    )
    for x, y in batches[: at - 1]:
        first(x, y)
    inlined = make_graph(
        alone, _loss, opt, backend="inductor", amp=torch.bfloat16,
        configure=lambda g: (g.config.set_outline_blocks(False), g.config.set_block_updates(False)),
    )  # fmt: skip
    for x, y in batches[at - 1 :]:
        inlined(x, y)
    assert_bitwise(model.state_dict(), alone.state_dict())


def test_the_inlined_step_takes_over_and_training_goes_on_bitwise(beside, caplog):
    batches = _batches(4000)
    g, model, opt = _graph()
    with caplog.at_level(logging.INFO, logger="graphamp"):
        g(*batches[0])
        assert _outlined(g) and g.compiled_steps[-1].taking_over  # the fast compile first
        calls = 1 + _train_until_taken_over(g, batches[1:])
        for x, y in batches[calls : calls + 3]:
            g(x, y)
    assert "the inlined step takes over at call" in caplog.text, caplog.text
    assert not _outlined(g) and not g.compiled_steps[-1].taking_over  # the inlined step now
    _assert_trains_as_the_steps_it_ran(model, batches[: calls + 3], caplog.text)

    # a restart finds the inlined step noted, and starts on it
    restarted, _, _ = _graph()
    restarted(*batches[0])
    assert not _outlined(restarted) and _program(restarted).tier_up is None


@pytest.mark.slow  # three cold compiles of a symbolic-size step
def test_a_step_with_changing_lengths_is_taken_over_too(beside, caplog):
    """The sequence length marked dynamic: the child makes the batch's symbols as this
    process did, and the take-over serves every length after it, training on bitwise."""
    gen = torch.Generator().manual_seed(2)
    lengths = [8, 5, 11, 7]
    batches = []
    for i in range(4000):
        t = lengths[i % len(lengths)]
        x, y = torch.randn(2, t, 8, generator=gen), torch.randint(0, 10, (2, t), generator=gen)
        torch._dynamo.mark_dynamic(x, 1)
        torch._dynamo.mark_dynamic(y, 1)
        batches.append((x, y))
    g, model, _ = _graph()
    g(*batches[0])
    g(*batches[1])
    if len(g.compiled_steps) > 1:  # torch 2.11's fake tensors pin the length (SDPA)
        pytest.skip("this torch's trace pins the length: a step per length")
    with caplog.at_level(logging.INFO, logger="graphamp"):
        calls = 2 + _train_until_taken_over(g, batches[2:])
        for x, y in batches[calls : calls + 4]:
            g(x, y)
    assert "the inlined step takes over at call" in caplog.text, caplog.text
    assert len(g.compiled_steps) == 1
    assert not _outlined(g)
    _assert_trains_as_the_steps_it_ran(model, batches[: calls + 4], caplog.text)


@pytest.mark.parametrize(
    "child, wait_s, why",
    [
        ("import sys; sys.exit(3)", 3600.0, "the child's compile failed"),
        pytest.param(
            "import time; time.sleep(60)",
            1.0,
            "the child was still compiling after 1 s",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_failed_child_leaves_the_first_step_running(
    beside, monkeypatch, caplog, child, wait_s, why
):
    monkeypatch.setattr(side_compile, "_CHILD", child)
    monkeypatch.setattr(tier_up, "WAIT_S", wait_s)
    batches = _batches(400)
    g, _, _ = _graph()
    with caplog.at_level(logging.INFO, logger="graphamp"):
        calls = _train_until_taken_over(g, batches)
        losses = [g(x, y).item() for x, y in batches[calls : calls + 2]]
    assert f"does not take over: {why}" in caplog.text, caplog.text
    assert _outlined(g) and all(map(math.isfinite, losses))  # trains on, outlined


@pytest.mark.slow  # one more cold compile of the inlined step
def test_deterministic_algorithms_compile_the_chosen_step_first(beside):
    """Where the user asked torch for deterministic algorithms, the step the cost model chose
    compiles at the first call: the take-over could change the last bits at a call that
    depends on the machine."""
    torch.use_deterministic_algorithms(True)
    try:
        g, _, _ = _graph()
        g(*_batches(1)[0])
    finally:
        torch.use_deterministic_algorithms(False)
    assert not _outlined(g) and _program(g).tier_up is None
