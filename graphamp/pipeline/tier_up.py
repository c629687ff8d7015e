"""The steady step compiled beside training, taking over when it is ready (issue 64).

The cost model (``step/block_work.py``) inlines small repeated blocks and their updates: their
steady step is faster inlined, by 8-9% on transformers' 6-layer GPT-2 at width 128 (outlined
1.093, block updates 1.078, ``benchmarks/results/paired_steps_variants_cpu.md``). But inductor
generates an inlined block's kernels once per block, and that first call took 1.88x
torch.compile's (``first_call_cpu.md``, round 14), where the outlined step with one update
kernel per block compiles in about half the time.

So where the chosen step is not the one that compiles fastest, and the user set neither
``config.set_outline_blocks`` nor ``config.set_block_updates``, the first call compiles the
fast one (blocks outlined, their updates by one kernel each), and the chosen step is compiled
in a child process while training runs. Once the program has run ``AFTER_CALLS`` times and
been in use as long as its build took (``TRAINED_PER_BUILT``), this process assembles the
chosen step and saves it in the step cache, and a child
(``side_compile.py``'s) compiles it, writing inductor's entries and its note. The child runs
at training's priority: niced, it got a tenth of a core beside training's two threads (which
spin between parallel regions) and had not finished after 600 s on a 2-core CPU. At the first
call after the child is done, this process makes the step from the note as a restart would
and takes it over; a restart finds the chosen step noted and starts on it.

The two steps read the same inputs, and trained bitwise alike on block stacks; on the
benchmarks' GPT (3 layers, one thread) the blocks' parameters stayed bitwise alike but the
embeddings' and the tied output layer's did not, from the first step, so when the take-over
happens can change the last bits of a run. With ``torch.use_deterministic_algorithms(True)`` there is no take-over: the chosen
step compiles at the first call (``stages.first_choices``).

Where the child fails, or its compile does not match this process's (another context), the
program keeps its first step, which is correct and a few percent slower; the reason is logged.
Only for CPU steps, with the step cache on, inductor, no process group, and where the side
compile applies (two or more cores, ``GRAPHAMP_SIDE_COMPILE`` not 0).
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from ..backend import step_values
from ..records.deferred import DeferredGraph
from ..records.spec import Program, StepFn
from ..torchkit.frame_stack import on_roomy_stack
from .side_compile import SideCompile, context_state

log = logging.getLogger("graphamp")

# the calls a program runs on its first step before the chosen step is compiled beside it: a
# few percent of a step each (8-9% on the small-block GPT-2), against 1-4 s of assembly here
# and a second compile for a program that may be called no more (a test, an evaluation, a
# shape seen a few times before the sizes are made symbolic)
AFTER_CALLS = 20
# ... and only once it has been in use at least this many times as long as its build took (a
# proxy for what the child costs: on a 2-core CPU its compile slowed training 3.7x for 110 s
# beside a 35 s first call), so that a run too short to repay a second compile does not pay
# for one: the changing-lengths benchmark's 200 steps took 117 s with the child started at the
# 20th call against 105 s for torch.compile
TRAINED_PER_BUILT = 1.0
WAIT_S = 3600.0  # a child still compiling after this long is stopped, and the first step kept

# (the step's function, its graph): made from the child's note; None where it cannot be
Made = tuple[StepFn, DeferredGraph] | None


@dataclass(frozen=True)
class Later:
    """What the chosen step needs from its build: ``prepare`` assembles and saves it (False:
    not saved), ``make`` makes it from the note the child wrote; ``request`` is the child's
    (``step_request``); ``words`` say what the chosen step is, for the log."""

    prepare: Callable[[], bool]
    make: Callable[[], Made]
    request: dict
    words: str


class TierUp:
    """A program's pending take-over: started once its run is long (``_run_is_long``), done at
    the first call after the child exits (``on_call``), then dropped from the program."""

    # the children compiling now, by their tier-up's id: one at a time (a child whose program
    # was dropped but not yet collected counts while it runs: it holds a core all the same)
    _running: dict[int, SideCompile] = {}

    def __init__(self, graph_name: str, later: Later) -> None:
        self.graph_name = graph_name
        self.later = later
        self.side: SideCompile | None = None
        self.started = 0.0
        self.first_call: float | None = None  # when the program was first called (just built)

    def on_call(self, program: Program) -> None:
        """Before each call of ``program``: start the child, or take its step over."""
        call = program.runner.calls + 1  # this call's number (the runner counts those done)
        side = self.side
        if side is None:
            if self._run_is_long(program, call) and not _others_running():
                self._start(program, call)
        elif not side.running():
            self._take_over(program, side, call)
        elif time.perf_counter() - self.started > WAIT_S:
            _stop(side, id(self))
            self._give_up(program, f"the child was still compiling after {WAIT_S:.0f} s")

    def _run_is_long(self, program: Program, call: int) -> bool:
        now = time.perf_counter()
        if self.first_call is None:
            self.first_call = now
        in_use = now - self.first_call
        return call >= AFTER_CALLS and in_use >= TRAINED_PER_BUILT * sum(program.timings.values())

    def _start(self, program: Program, call: int) -> None:
        try:
            saved = on_roomy_stack(self.later.prepare)
        except Exception as e:  # the first step runs on: it is correct, only slower
            return self._give_up(program, f"assembling it failed ({type(e).__name__}: {e})")
        if not saved:
            return self._give_up(program, "it could not be saved in the step cache")
        side = SideCompile.spawn(self.graph_name)
        if side is None:
            return self._give_up(program, "no child process could be started")
        if not side.request_step({**self.later.request, "context": context_state()}):
            return self._give_up(program, "the child could not be given the step")
        self.side, self.started = side, time.perf_counter()
        TierUp._running[id(self)] = side
        weakref.finalize(self, _stop, side, id(self))  # the program dropped: the child goes too
        log.info(
            "%s: compiling the %s beside training (%d call%s so far on the step that compiles "
            "fastest)",
            self.graph_name,
            self.later.words,
            call - 1,
            "" if call == 2 else "s",
        )

    def _take_over(self, program: Program, side: SideCompile, call: int) -> None:
        compiled_s = time.perf_counter() - self.started
        finished = side.finished(self.graph_name)
        _stop(side, id(self))
        if not finished:
            return self._give_up(program, "the child's compile failed (the debug log says why)")
        start = time.perf_counter()
        try:
            made = on_roomy_stack(self.later.make)
        except Exception as e:
            return self._give_up(program, f"making it failed ({type(e).__name__}: {e})")
        if made is None:
            return self._give_up(program, "the child's compile is not this process's")
        program.runner.compiled, program.step = made  # type: ignore[attr-defined]
        program.tier_up = None
        log.info(
            "%s: the %s takes over at call %d (compiled beside training in %.1f s, made here "
            "in %.2f s)",
            self.graph_name,
            self.later.words,
            call,
            compiled_s,
            time.perf_counter() - start,
        )

    def _give_up(self, program: Program, why: str) -> None:
        program.tier_up = None
        log.info("%s: the %s does not take over: %s", self.graph_name, self.later.words, why)


def _stop(side: SideCompile, ident: int) -> None:
    side.stop()
    TierUp._running.pop(ident, None)


def _others_running() -> bool:
    """Whether a child compiles now (those that have exited are forgotten here)."""
    for ident, side in list(TierUp._running.items()):
        if not side.running():
            TierUp._running.pop(ident, None)
    return bool(TierUp._running)


def step_request(
    graph_name: str,
    key: str,
    example: list,
    batch: list,
    dynamic: frozenset,
    options: dict[str, Any],
) -> dict:
    """What the child needs to compile the step saved under ``key``: its example inputs in the
    step cache's form (symbolic sizes as expressions over the batch's symbols), the batch's
    sizes and which of them are symbolic (so that the child makes the same symbols), the
    user's inductor options."""
    return {
        "graph": graph_name,
        "key": key,
        "example": [step_values.encode(t) for t in example],
        "batch": [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in batch],
        "dynamic": sorted(dynamic),
        "options": dict(options),
    }
