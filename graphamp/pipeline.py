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

from .capture import BuildRoot, autocast_forward, capture_forward, check_devices, pinned_paths
from .errors import ConfigError
from .fxutil import copy_graph_module
from .inputs import FlatInputs
from .passes import DEFAULT_LISTS, AmpContext, run_amp_passes
from .pins import PinMatch, resolve_pins
from .runtime import CudaGraphStep, Runner, compile_step
from .runtime import distributed
from .spec import AutocastTrace, CapturedForward, GraphSpec, PassRecord, Program, StepPlan
from .state import SharedState
from .step import assemble_step, build_plan

log = logging.getLogger("graphamp")

STAGES = ("capture", "amp_passes", "plan", "assemble", "compile")


def build_program(spec: GraphSpec, inputs: FlatInputs, state: SharedState) -> Program:
    """Every stage, in STAGES order, for one input signature."""
    if not spec.config.data_parallel:
        return _build(spec, inputs, state)
    group = distributed.process_group(spec.name, spec.config)
    if not state.broadcast_done:
        distributed.broadcast_state(spec.name, BuildRoot(spec.modules, spec.build), group)
        state.broadcast_done = True
    return distributed.build_on_every_rank(
        spec.name, group, lambda: _build(spec, inputs, state, group),
        lambda p: distributed.fingerprint(p.step_gm, p.plan.layout.names))


def _build(spec: GraphSpec, inputs: FlatInputs, state: SharedState,
           process_group: Any = None) -> Program:
    config = spec.config
    if config.grad_acc_steps > 1 and not spec.training:
        raise ConfigError(f"{spec.name}: gradient accumulation splits a training step into "
                          "micro-batches, but the graph has no optimizer")
    timings: dict[str, float] = {}
    root = BuildRoot(spec.modules, spec.build)
    device = check_devices(spec.name, root, inputs)
    traced = inputs.micro_batch(config.grad_acc_steps, spec.name) \
        if config.grad_acc_steps > 1 else inputs
    captured = _timed(timings, "capture", capture_forward, root, traced, spec.name)
    records = [PassRecord("captured", captured.gm.code, timings["capture"], True)]
    forward, amp = _amp_passes(spec, root, captured, records, timings)
    plan = _plan(spec, captured, root, forward, amp, process_group)
    runner = Runner(plan, root, state, device)
    example = runner.example_inputs(inputs.tensors)
    step_gm = _timed(timings, "assemble", assemble_step, plan, forward, example, spec.name)
    runner.compiled = _timed(timings, "compile", compile_step, step_gm, example, config.backend,
                             dict(config.inductor_options))
    if device.type == "cuda" and config.backend != "eager" and config.cuda_graph is not False:
        _replay_as_cuda_graph(spec.name, runner, plan, inputs.tensors)
    return Program(spec, inputs.signature, captured, forward, amp, plan, step_gm, runner, device,
                   timings, records, example_inputs=inputs.as_meta())


def _timed(timings: dict[str, float], stage: str, fn: Callable, *args: Any) -> Any:
    start = time.perf_counter()
    out = fn(*args)
    timings[stage] = time.perf_counter() - start
    return out


def _amp_passes(spec: GraphSpec, root: BuildRoot, captured: CapturedForward,
                records: list[PassRecord], timings: dict[str, float]):
    """The AMP passes on a copy of the captured forward: (forward, AmpContext | None)."""
    config = spec.config
    if not config.amp_active:
        return captured.gm, None
    n_params = len(captured.param_names)
    placeholders = [n.name for n in captured.gm.graph.nodes if n.op == "placeholder"]
    pins = _resolve_pins(spec, root, captured)
    amp = AmpContext(dtype=config.amp_dtype,
                     lists=DEFAULT_LISTS.with_overrides(config.list_overrides),
                     opt_level=config.amp_opt_level,
                     pinned_paths=pinned_paths(root, config.fp32_module_types,
                                               config.fp32_module_names) | pins.modules,
                     pinned_nodes=pins.nodes,
                     parameters=frozenset(placeholders[:n_params]))

    def record(pass_name: str, gm: fx.GraphModule, modified: bool, seconds: float) -> None:
        # python_code, not recompile: the code text without compiling it
        records.append(PassRecord(pass_name, gm.graph.python_code("self").src, seconds, modified))
        log.log(logging.DEBUG if spec.debug_level < 2 else logging.INFO,
                "%s: pass %s %.1f ms%s", spec.name, pass_name, seconds * 1e3,
                "" if modified else " (no change)")

    start = time.perf_counter()
    forward = run_amp_passes(copy_graph_module(captured.gm), amp, after_pass=record)
    timings["amp_passes"] = time.perf_counter() - start
    return forward, amp


def _resolve_pins(spec: GraphSpec, root: BuildRoot, captured: CapturedForward) -> PinMatch:
    """The ops and modules config.amp_pins names in this capture; a pin that names nothing
    (the model changed since autofix made it, or a state dict from another model) is reported
    and left out, not an error: pins are fixes, and the step is still correct without one."""
    pins = resolve_pins(captured.gm, spec.config.amp_pins,
                        [path for path, _ in root.named_modules() if path])
    for pin in pins.unmatched:
        log.warning("%s: fp32 pin %s names no op of this graph; it is ignored (clear it with "
                    "g.config.clear_amp_pins(pin))", spec.name, pin.describe())
    return pins


def _plan(spec: GraphSpec, captured: CapturedForward, root: BuildRoot, forward: fx.GraphModule,
          amp: AmpContext | None, process_group: Any) -> StepPlan:
    n_params = len(captured.param_names)
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    index = {node.name: i for i, node in enumerate(placeholders[:n_params])}
    param_casts = [(index[name], dtype) for name, dtype in (amp.hoisted if amp else [])]
    direct_use = {i for i in range(n_params) if placeholders[i].users}
    return build_plan(spec, captured, forward, [id(p) for p in root.parameters()], param_casts,
                      direct_use, process_group)


def _replay_as_cuda_graph(name: str, runner: Runner, plan: StepPlan,
                          inputs: list[torch.Tensor]) -> None:
    compiled = runner.compiled
    try:
        runner.compiled = CudaGraphStep(compiled, plan.layout.n_state, runner.gather(inputs))
        runner.uses_cuda_graph = True
    except Exception as e:  # noqa: BLE001 - fall back, and say why
        log.warning("%s: CUDA graph capture failed, running without it: %s: %s", name,
                    type(e).__name__, e)
        runner.compiled = compiled


def trace_autocast(program: Program) -> AutocastTrace:
    """What torch.autocast does on the program's forward (the precision report's oracle)."""
    root = BuildRoot(program.spec.modules, program.spec.build)
    return autocast_forward(root, program.example_inputs, program.amp.dtype, program.device)
