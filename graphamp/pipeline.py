"""The pipeline: the only caller of the stages, in one literal order.

    GraphSpec + inputs ─capture─▶ CapturedForward ─amp_passes─▶ forward + AmpContext
      ─plan─▶ StepPlan ─assemble─▶ step graph ─compile─▶ Program

``Graph`` hands this module a GraphSpec (what was registered and configured), the call's
flattened inputs and the graph's SharedState; it gets a Program back. No stage reads ``Graph``;
each reads the record the previous stage made (``spec.py``). ``docs/architecture.md`` has the
picture and the import rules.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
import torch.fx as fx

from .capture import (
    BuildRoot,
    autocast_forward,
    capture_forward,
    check_devices,
    check_not_fsdp,
    checkpointed_paths,
    pinned_paths,
)
from .errors import ConfigError
from .passes import DEFAULT_LISTS, AmpContext, run_amp_passes
from .records.fxutil import copy_graph_module
from .records.inputs import FlatInputs
from .records.pins import PinMatch, resolve_pins
from .records.spec import AutocastTrace, CapturedForward, GraphSpec, PassRecord, Program, StepPlan
from .records.stage_errors import PASS_THROUGH as _PASS_THROUGH
from .records.stage_errors import stage_error
from .records.state import SharedState
from .runtime import CudaGraphStep, Runner, compile_step, distributed
from .step import assemble_step, build_plan, recompute_checkpointed

log = logging.getLogger("graphamp")

STAGES = ("capture", "amp_passes", "plan", "assemble", "compile")


def build_program(spec: GraphSpec, inputs: FlatInputs, state: SharedState) -> Program:
    """Every stage, in STAGES order, for one input signature.

    Whatever a stage raises reaches the user as a graphamp error naming the stage, the user's
    line where the failure has one, and what to try; torch's exception is its ``__cause__``.
    graphamp's own errors, Ctrl-C and out-of-memory errors pass through as they are."""
    stages = _Stages(spec.name)
    try:
        return _build_program(spec, inputs, state, stages)
    except _PASS_THROUGH:
        raise
    except Exception as e:  # noqa: BLE001 - every other failure becomes graphamp's
        raise stage_error(spec, stages.current, e) from e


def _build_program(
    spec: GraphSpec, inputs: FlatInputs, state: SharedState, stages: _Stages
) -> Program:
    if not spec.config.data_parallel:
        return _build(spec, inputs, state, stages)
    group = distributed.process_group(spec.name, spec.config)
    if not state.broadcast_done:
        distributed.broadcast_state(spec.name, BuildRoot(spec.modules, spec.build), group)
        state.broadcast_done = True
    return distributed.build_on_every_rank(
        spec.name,
        group,
        lambda: _build(spec, inputs, state, stages, group),
        lambda p: distributed.fingerprint(p.step_gm, p.plan.layout.names),
    )


def _build(
    spec: GraphSpec,
    inputs: FlatInputs,
    state: SharedState,
    stages: _Stages,
    process_group: Any = None,
) -> Program:
    config = spec.config
    if config.grad_acc_steps > 1 and not spec.training:
        raise ConfigError(
            f"{spec.name}: gradient accumulation splits a training step into "
            "micro-batches, but the graph has no optimizer"
        )
    root = BuildRoot(spec.modules, spec.build)
    check_not_fsdp(spec.name, root)
    device = check_devices(spec.name, root, inputs)
    traced = (
        inputs.micro_batch(config.grad_acc_steps, spec.name)
        if config.grad_acc_steps > 1
        else inputs
    )
    captured = stages.run(
        "capture", capture_forward, root, traced, spec.name, None, config.amp_active
    )
    records = [PassRecord("captured", captured.gm.code, stages.timings["capture"], True)]
    forward, amp = stages.run("amp_passes", _amp_passes, spec, root, captured, records)
    plan = stages.run("plan", _plan, spec, captured, root, forward, amp, process_group)
    runner = Runner(plan, root, state, device)
    example = runner.example_inputs(inputs.tensors)
    step_gm = stages.run("assemble", assemble_step, plan, forward, example, spec.name)
    regions = checkpointed_paths(
        root, config.checkpoint_module_types, config.checkpoint_module_names
    )
    if regions and spec.training:
        recomputed = stages.run("recompute", recompute_checkpointed, step_gm, regions)
        log.info(
            "%s: activation checkpointing recomputes %d ops in %d regions",
            spec.name,
            recomputed.copies,
            len(recomputed.regions),
        )
    runner.compiled = stages.run(
        "compile", compile_step, step_gm, example, config.backend, dict(config.inductor_options)
    )
    if device.type == "cuda" and config.backend != "eager" and config.cuda_graph is not False:
        _replay_as_cuda_graph(spec.name, runner, plan, inputs.tensors)
    return Program(
        spec,
        inputs.signature,
        captured,
        forward,
        amp,
        plan,
        step_gm,
        runner,
        device,
        dict(stages.timings),
        records,
        example_inputs=inputs.as_meta(),
    )


class _Stages:
    """Runs the stages, timing each and remembering which one is running (for errors)."""

    def __init__(self, graph_name: str) -> None:
        self.graph_name = graph_name
        self.current = "capture"
        self.timings: dict[str, float] = {}

    def run(self, stage: str, fn: Callable, *args: Any) -> Any:
        self.current = stage
        start = time.perf_counter()
        out = fn(*args)
        self.timings[stage] = time.perf_counter() - start
        return out


def _amp_passes(
    spec: GraphSpec, root: BuildRoot, captured: CapturedForward, records: list[PassRecord]
):
    """The AMP passes on a copy of the captured forward: (forward, AmpContext | None)."""
    config = spec.config
    if not config.amp_active:
        return captured.gm, None
    n_params = len(captured.param_names)
    placeholders = [n.name for n in captured.gm.graph.nodes if n.op == "placeholder"]
    module_pins = pinned_paths(
        root, config.fp32_module_types, config.fp32_module_names, config.amp_dtype
    )
    pins = _resolve_pins(spec, root, captured)
    amp = AmpContext(
        dtype=config.amp_dtype,
        lists=DEFAULT_LISTS.with_overrides(config.list_overrides),
        opt_level=config.amp_opt_level,
        pinned_paths=frozenset(module_pins) | pins.modules,
        pin_reasons=module_pins,
        pinned_nodes=pins.nodes,
        parameters=frozenset(placeholders[:n_params]),
    )

    def record(pass_name: str, gm: fx.GraphModule, modified: bool, seconds: float) -> None:
        # python_code, not recompile: the code text without compiling it
        records.append(PassRecord(pass_name, gm.graph.python_code("self").src, seconds, modified))
        log.log(
            logging.DEBUG if spec.debug_level < 2 else logging.INFO,
            "%s: pass %s %.1f ms%s",
            spec.name,
            pass_name,
            seconds * 1e3,
            "" if modified else " (no change)",
        )

    forward = run_amp_passes(copy_graph_module(captured.gm), amp, after_pass=record)
    return forward, amp


def _resolve_pins(spec: GraphSpec, root: BuildRoot, captured: CapturedForward) -> PinMatch:
    """The ops and modules config.amp_pins names in this capture; a pin that names nothing
    (the model changed since autofix made it, or a state dict from another model) is reported
    and left out, not an error: pins are fixes, and the step is still correct without one."""
    pins = resolve_pins(
        captured.gm, spec.config.amp_pins, [path for path, _ in root.named_modules() if path]
    )
    for pin in pins.unmatched:
        log.warning(
            "%s: fp32 pin %s names no op of this graph; it is ignored (clear it with "
            "g.config.clear_amp_pins(pin))",
            spec.name,
            pin.describe(),
        )
    return pins


def _plan(
    spec: GraphSpec,
    captured: CapturedForward,
    root: BuildRoot,
    forward: fx.GraphModule,
    amp: AmpContext | None,
    process_group: Any,
) -> StepPlan:
    n_params = len(captured.param_names)
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    index = {node.name: i for i, node in enumerate(placeholders[:n_params])}
    param_casts = [(index[name], dtype) for name, dtype in (amp.hoisted if amp else [])]
    direct_use = {i for i in range(n_params) if placeholders[i].users}
    return build_plan(
        spec,
        captured,
        forward,
        [id(p) for p in root.parameters()],
        param_casts,
        direct_use,
        process_group,
    )


def _replay_as_cuda_graph(
    name: str, runner: Runner, plan: StepPlan, inputs: list[torch.Tensor]
) -> None:
    compiled = runner.compiled
    try:
        runner.compiled = CudaGraphStep(compiled, plan.layout.n_state, runner.gather(inputs))
        runner.uses_cuda_graph = True
    except Exception as e:  # noqa: BLE001 - fall back, and say why
        log.warning(
            "%s: CUDA graph capture failed, running without it: %s: %s", name, type(e).__name__, e
        )
        runner.compiled = compiled


def trace_autocast(program: Program) -> AutocastTrace:
    """What torch.autocast does on the program's forward (the precision report's oracle)."""
    root = BuildRoot(program.spec.modules, program.spec.build)
    try:
        return autocast_forward(root, program.example_inputs, program.amp.dtype, program.device)
    except _PASS_THROUGH:
        raise
    except Exception as e:  # noqa: BLE001 - as in build_program
        raise stage_error(program.spec, "capture", e) from e
