"""One call of a Graph: find its compiled step, and run it as a transaction.

A Graph owns one ``GraphRuntime``: what its calls share besides the compiled steps' own runners
(the cache of Programs, the structure key, the graph's own state, the scaler, autofix). Its
containers are the Graph's own (registered modules, optimizer slots, config), so what the user
registers or sets is what the next call sees. ``call`` is the one function a call enters in
``runtime/``; ``run_step`` owns a step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from ..forensics.autofix import Autofix
from ..records.inputs import FlatInputs, flatten_inputs
from ..records.spec import OptimizerSlot, Program
from ..records.state import SharedState
from . import ambient, interrupts, schedulers
from .cache_key import ProgramKey, StructureKey
from .overflows import read_overflows, watch_overflows

if TYPE_CHECKING:  # the user's objects, held and called, never constructed here
    from ..config import GraphConfig
    from ..scaler import GradScaler

log = logging.getLogger("graphamp")

# the Graph's miss path: capture and compile a step for these inputs, keep it in the cache
Compile = Callable[[FlatInputs, ProgramKey, tuple, dict], Program]


@dataclass(eq=False)
class GraphRuntime:
    """What a Graph's calls read and write (see the module docstring)."""

    name: str  # the Graph subclass's name: every message starts with it
    modules: dict[str, nn.Module]  # the Graph's registered modules (the same dict)
    optimizers: list[OptimizerSlot]  # the Graph's add_optimizer slots (the same list)
    config: GraphConfig  # the Graph's config: snapshot() at every call; autofix settings
    state: SharedState  # step count, optimizer step counters, history
    compile: Compile
    programs: OrderedDict[ProgramKey, Program] = field(default_factory=OrderedDict)  # LRU first
    structure: StructureKey = field(default_factory=StructureKey)
    autofix: Autofix = field(default_factory=Autofix)
    scaler: GradScaler | None = None  # set_grad_scaler's (disabled ones included)
    debug_level: int = 0
    last_key: ProgramKey | None = None  # the key of the last call (why a step is rebuilt)
    warned_numbers: bool = False  # the baked-in numbers warning is given once


def call(run: GraphRuntime, args: tuple, kwargs: dict) -> Any:
    """``g(*args, **kwargs)``: the compiled step for these inputs (the Graph compiles it on a
    miss), run as one step; build()'s return value with this step's tensors."""
    neutral = ambient.neutral_modes()  # an ambient autocast or inference mode
    if neutral is None:
        return _call(run, args, kwargs)
    with neutral:
        return _call(run, args, kwargs)


def _call(run: GraphRuntime, args: tuple, kwargs: dict) -> Any:
    inputs = flatten_inputs(args, kwargs)
    key = program_key(run, inputs)
    program = run.programs.get(key)
    if program is None:
        program = run.compile(inputs, key, args, kwargs)
    else:
        run.programs.move_to_end(key)
    run.last_key = key
    return program.captured.unflatten_outputs(run_step(run, program, inputs))


def program_key(run: GraphRuntime, inputs: FlatInputs) -> ProgramKey:
    """The cache key of a call with ``inputs``, as the Graph's objects are now."""
    structure = run.structure(
        run.modules, run.optimizers, run.config.snapshot(), run.scaler, ambient.mode_key()
    )
    return tuple.__new__(ProgramKey, (inputs.signature, structure))  # no Python-level __init__


def run_step(run: GraphRuntime, program: Program, inputs: FlatInputs) -> list[torch.Tensor]:
    """One step as a transaction: whatever raises, parameters, optimizer state, scaler,
    counters, history and schedulers are all from before the step or all from after it.

    The step's inputs (this step's learning rates included) are gathered first. Then, with
    Ctrl-C held back (``interrupts.py``): the schedulers step (snapshotted first), the
    bookkeeping is recorded, and the compiled step runs, last, as the one thing that cannot be
    undone. If anything before it fails, the rest is undone. With overflow tracing the compiled
    step writes its overflow record on the device with the rest of the state; what the host then
    reads of it (``watch_overflows``) happens after the step is committed, still with Ctrl-C
    held, so the host's list of overflows and the device count it has read up to move together.
    """
    runner = program.runner
    flat = runner.gather(inputs.tensors)
    stepping = [s.lr_sch for s in run.optimizers if s.lr_sch is not None]
    saved = [schedulers.snapshot(sch) for sch in stepping]
    undo = None
    held = interrupts.hold_interrupts()
    try:
        try:
            for sch in stepping:
                sch.step()  # sets the next step's lr; this step's is already gathered
            undo = runner.record_step()
            run.state.step_count += 1
            outputs = runner.execute(flat)
        except BaseException:
            if undo is not None:
                undo()
                run.state.step_count -= 1
            for snapshot in saved:
                schedulers.restore(snapshot)
            raise
        # committed: from here on nothing undoes the step
        if runner.forensics is not None:
            watch_overflows(run, program)
    finally:
        if held:
            interrupts.release_interrupts()  # a Ctrl-C that arrived meanwhile is raised here
    return outputs


def keep_program(run: GraphRuntime, key: ProgramKey, program: Program) -> None:
    """Cache a new compiled step; drop the least recently used beyond
    ``config.max_cached_graphs`` (its overflow record is read first: it goes with it)."""
    run.programs[key] = program
    while len(run.programs) > run.config.max_cached_graphs:
        _, dropped = run.programs.popitem(last=False)
        read_overflows(run, dropped)
        log.info(
            "%s: dropped the least recently used compiled step (cache holds %d)",
            run.name,
            run.config.max_cached_graphs,
        )
