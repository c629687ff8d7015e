"""The pipeline: the only caller of the stages, in the order of ``STAGES``.

    GraphSpec + inputs ─capture─▶ CapturedForward ─amp_passes─▶ forward + AmpContext
      ─plan─▶ StepPlan ─assemble─▶ step graph (─recompute─▶) ─compile─▶ Program

``Graph`` hands this module a GraphSpec (what was registered and configured), the call's
flattened inputs and the graph's SharedState; it gets a Program back. No stage reads ``Graph``;
each reads the records the previous stages made (``records/spec.py``), and each is visited
once, in order: the runtime's Runner is made last, around the compiled step.
``docs/architecture.md`` has the picture and the import rules.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple

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
from .records.guards import BuildRequest, Guards, StateSize
from .records.inputs import FlatInputs
from .records.pins import PinMatch, resolve_pins
from .records.shapes import fake_batch, new_fake_mode, shape_guard
from .records.spec import AutocastTrace, CapturedForward, GraphSpec, PassRecord, Program, StepPlan
from .records.stage_errors import PASS_THROUGH as _PASS_THROUGH
from .records.stage_errors import stage_error
from .records.state import SharedState
from .runtime import Runner, compile_step, distributed, step_cache
from .runtime.compile import StepFn
from .runtime.inductor_cache import compile_from_cache
from .runtime.progress import CompileProgress, log_stage
from .runtime.step_key import Uncacheable, step_key
from .step import (
    OutlineResult,
    assemble_step,
    build_plan,
    example_inputs,
    outline_blocks,
    recompute_checkpointed,
)
from .step.traced_optimizer import check_traceable_state

__all__ = ["build_program", "check_traceable_state", "trace_autocast"]

log = logging.getLogger("graphamp")


class _Build:
    """What the stages of one build have made so far; each stage reads earlier fields and sets
    its own (an attribute is missing until its stage ran)."""

    def __init__(
        self, spec: GraphSpec, inputs: FlatInputs, state: SharedState, request: BuildRequest
    ) -> None:
        self.spec = spec
        self.inputs = inputs
        self.state = state
        self.request = request
        # one fake mode for every stage: the batch's symbolic sizes are the same symbols in
        # capture, assembly and the backend, and what they assume of them lands in one ShapeEnv
        self.fake_mode = new_fake_mode()
        self.batch = inputs.with_tensors(
            fake_batch(self.fake_mode, inputs.tensors, request.dynamic)
        )
        self.root = BuildRoot(spec.modules, spec.build)
        self.process_group: Any = None  # data parallel: the group gradients are averaged over
        self.stage = "capture"  # the stage running (named in errors)
        self.timings: dict[str, float] = {}
        self.records: list[PassRecord] = []

    # set by the stages, in this order
    device: torch.device
    captured: CapturedForward
    module_pins: dict[str, str]  # module path -> why it stays fp32 (AMP on)
    regions: frozenset[str]  # activation checkpointing regions
    forward: fx.GraphModule
    amp: AmpContext | None
    plan: StepPlan
    example: list[torch.Tensor]
    step_gm: fx.GraphModule
    compiled: StepFn
    outline: OutlineResult  # repeated blocks outlined (config.set_outline_blocks)
    cache_key: str | None = None  # the step cache's key (None: not cached or not looked up)
    cache_note: str  # what the step cache did, for its INFO line
    loaded: bool = False  # the step came from the step cache: assembly and outlining skipped
    compile_detail: str  # what the compile stage's log line says besides its seconds


class Stage(NamedTuple):
    name: str
    run: Callable[[_Build], None]
    wanted: Callable[[_Build], bool] | None = None  # None: always
    describe: Callable[[_Build], str] | None = None  # what its INFO line says it made


def build_program(
    spec: GraphSpec, inputs: FlatInputs, state: SharedState, request: BuildRequest
) -> Program:
    """Every stage, in STAGES order, for one input signature (``request.dynamic``: the batch
    dimensions traced as symbols; the program then serves every size its guards admit).

    Whatever a stage raises reaches the user as a graphamp error naming the stage, the user's
    line where the failure has one, and what to try; torch's exception is its ``__cause__``.
    graphamp's own errors, Ctrl-C and out-of-memory errors pass through as they are. Python
    state capture settled on the user's objects (``capture/steady_state.py``) is put back on
    any failure."""
    b = _Build(spec, inputs, state, request)
    with _one_build_at_a_time(spec.name):
        try:
            with _undone_on_failure(b):
                return _build_program(b)
        except _PASS_THROUGH:
            raise
        except Exception as e:  # every other failure becomes graphamp's
            raise stage_error(spec, b.stage, e) from e


# torch's tracing (make_fx, fake tensors, the backends' compilers) keeps process-wide state,
# and capture installs process-wide hooks and patches: two builds in two threads would trip
# over each other's. Builds take turns (steady calls, which trace nothing, do not wait).
_BUILD_LOCK = threading.RLock()


@contextlib.contextmanager
def _one_build_at_a_time(name: str) -> Iterator[None]:
    if not _BUILD_LOCK.acquire(blocking=False):
        log.info("%s: waiting for another Graph's capture and compile to finish", name)
        _BUILD_LOCK.acquire()
    try:
        yield
    finally:
        _BUILD_LOCK.release()


@contextlib.contextmanager
def _undone_on_failure(b: _Build) -> Iterator[None]:
    try:
        yield
    except BaseException:
        captured = getattr(b, "captured", None)
        if captured is not None and captured.undo_writes is not None:
            captured.undo_writes()
        raise


def _build_program(b: _Build) -> Program:
    spec = b.spec
    if not spec.config.data_parallel:
        return _build(b)
    b.process_group = group = distributed.process_group(spec.name, spec.config)
    if not b.state.broadcast_done:
        distributed.broadcast_state(spec.name, b.root, group)
        b.state.broadcast_done = True
    return distributed.build_on_every_rank(
        spec.name,
        group,
        lambda: _build(b),
        lambda p: distributed.fingerprint(p.step_gm, p.plan.layout.names),
    )


def _build(b: _Build) -> Program:
    for stage in STAGES:
        if stage.wanted is not None and not stage.wanted(b):
            continue
        b.stage = stage.name
        start = time.perf_counter()
        stage.run(b)
        b.timings[stage.name] = seconds = time.perf_counter() - start
        log_stage(b.spec.name, stage.name, seconds, stage.describe(b) if stage.describe else "")
    config = b.spec.config
    replay = (
        b.device.type == "cuda" and config.backend != "eager" and config.cuda_graph is not False
    )
    runner = Runner(
        b.plan,
        b.root,
        b.state,
        b.device,
        b.compiled,
        cuda_graph_batch=b.inputs.tensors if replay else None,
        cuda_graph_sizes=config.cuda_graph_sizes if b.request.dynamic else None,
        graph_name=b.spec.name,
    )
    return Program(
        spec=b.spec,
        signature=b.inputs.signature,
        captured=b.captured,
        forward=b.forward,
        amp=b.amp,
        plan=b.plan,
        step_gm=b.step_gm,
        runner=runner,
        device=b.device,
        timings=dict(b.timings),
        pass_records=b.records,
        example_inputs=b.inputs.as_meta(),
        guards=_guards(b),
    )


def _guards(b: _Build) -> Guards:
    """What the program assumes (``records.guards``): the structure it was built for, the
    batch's shapes (the ShapeEnv's guards where dimensions are symbolic), the attributes build()
    read, the parameters' and buffers' sizes."""
    modules = dict(b.root.named_modules())
    sizes = []
    for kind, named in (
        ("_parameters", b.root.named_parameters()),
        ("_buffers", b.root.named_buffers()),
    ):
        for name, tensor in named:
            owner, _, attr = name.rpartition(".")
            namespace = getattr(modules[owner], kind)
            sizes.append(StateSize(f"self.{name}", namespace, attr, tensor.shape))
    return Guards(
        structure=b.request.structure,
        signature=b.inputs.signature,
        shapes=shape_guard(b.fake_mode, b.batch.tensors, b.request.dynamic),
        attributes=b.captured.attribute_reads,
        state_sizes=tuple(sizes),
        lifted=b.captured.lifted,
    )


# -- the stages ------------------------------------------------------------------------------------


def _capture(b: _Build) -> None:
    """build() traced, and the module facts the later stages need (checked once, here)."""
    spec, config = b.spec, b.spec.config
    if config.grad_acc_steps > 1 and not spec.training:
        raise ConfigError(
            f"{spec.name}: gradient accumulation splits a training step into "
            "micro-batches, but the graph has no optimizer"
        )
    check_not_fsdp(spec.name, b.root)
    b.device = check_devices(spec.name, b.root, b.inputs)
    traced = b.batch
    if config.grad_acc_steps > 1:
        b.inputs.check_micro_batches(config.grad_acc_steps, spec.name)
        traced = b.batch.micro_batch(config.grad_acc_steps)
    b.captured = capture_forward(
        b.root,
        traced,
        spec.name,
        None,
        config.amp_active,
        b.request.lifted,
        b.request.lifted_inputs,
        b.process_group if not config.zero_stage else None,
    )
    b.module_pins = {}
    if config.amp_active:
        b.module_pins = pinned_paths(
            b.root, config.fp32_module_types, config.fp32_module_names, config.amp_dtype
        )
    b.regions = checkpointed_paths(
        b.root, config.checkpoint_module_types, config.checkpoint_module_names
    )


def _fp8_recipe(b: _Build) -> str | None:
    """The fp8 recipe when enable_fp8 is on, after checking what it needs: bf16 AMP, and on
    CUDA a GPU with fp8 matmuls (compute capability 8.9, Ada and Hopper, or later)."""
    config, name = b.spec.config, b.spec.name
    if config.fp8_recipe is None:
        return None
    if not config.amp_active or config.amp_dtype != torch.bfloat16:
        raise ConfigError(
            f"{name}: enable_fp8 runs on top of bf16 AMP: call "
            "config.enable_amp(True, dtype=torch.bfloat16) (fp16 with fp8 is not offered: fp8 "
            "keeps its own scales, and bf16's range needs no loss scaler beneath them)"
        )
    device = b.device
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ConfigError(
                f"{name}: enable_fp8 needs a GPU with fp8 matmuls (compute capability 8.9 or "
                f"later: Ada, Hopper); this one has {capability[0]}.{capability[1]}"
            )
    return config.fp8_recipe


def _amp_passes(b: _Build) -> None:
    """The AMP passes on a copy of the captured forward (AMP off: the captured forward)."""
    spec, config, captured = b.spec, b.spec.config, b.captured
    b.records.append(PassRecord("captured", captured.gm.code, b.timings["capture"], True))
    b.forward, b.amp = captured.gm, None
    fp8 = _fp8_recipe(b)
    if not config.amp_active:
        return
    placeholders = [n.name for n in captured.gm.graph.nodes if n.op == "placeholder"]
    pins = _resolve_pins(spec, b.root, captured)
    b.amp = amp = AmpContext(
        dtype=config.amp_dtype,
        lists=DEFAULT_LISTS.with_overrides(config.list_overrides),
        opt_level=config.amp_opt_level,
        pinned_paths=frozenset(b.module_pins) | pins.modules,
        pin_reasons=b.module_pins,
        pinned_nodes=pins.nodes,
        parameters=frozenset(captured.layout.split(placeholders).params),
        user_outputs=captured.num_user_outputs,
        fp8=fp8,
        fp8_keep=frozenset(config.fp8_keep),
        fp8_keep_first_last=config.fp8_keep_first_last,
        fp8_history=config.fp8_history,
        fp8_margin=config.fp8_margin,
    )

    def record(pass_name: str, gm: fx.GraphModule, modified: bool, seconds: float) -> None:
        # python_code, not recompile: the code text without compiling it
        b.records.append(PassRecord(pass_name, gm.graph.python_code("self").src, seconds, modified))
        log.log(
            logging.DEBUG if spec.debug_level < 2 else logging.INFO,
            "%s: pass %s %.1f ms%s",
            spec.name,
            pass_name,
            seconds * 1e3,
            "" if modified else " (no change)",
        )

    b.forward = run_amp_passes(copy_graph_module(captured.gm), amp, after_pass=record)


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


def _plan(b: _Build) -> None:
    hoisted = b.amp.hoisted if b.amp is not None else []
    fp8_state = list(b.amp.fp8_state) if b.amp is not None else []
    layout = b.captured.layout.with_param_copies(len(hoisted)).with_fp8_state(len(fp8_state))
    params = layout.split([n for n in b.forward.graph.nodes if n.op == "placeholder"]).params
    index = {node.name: i for i, node in enumerate(params)}
    b.plan = build_plan(
        b.spec,
        b.captured,
        b.forward,
        [id(p) for p in b.root.parameters()],
        [(index[name], dtype) for name, dtype in hoisted],
        {i for i, node in enumerate(params) if node.users},
        b.process_group,
        fp8_state,
    )


def _examples(b: _Build) -> None:
    b.example = example_inputs(b.plan, b.root, b.state, b.batch.tensors, b.device)


def _not_cached(b: _Build) -> str | None:
    """Why this build does not use the step cache although it is on (None: it does)."""
    if b.request.dynamic:  # the loaded step's symbols would have to be this build's
        return "symbolic sizes are not cached yet"
    if b.spec.config.data_parallel:  # every rank would have to agree on hit or miss
        return "data-parallel steps are not cached yet"
    return None


def _cached_step(b: _Build) -> None:
    """The step cache (``runtime/step_cache.py``): the key of what assembly and outlining
    would read, and the step saved under it by an earlier run, if any."""
    why_not = _not_cached(b)
    if why_not is not None:
        b.cache_note = f"not used: {why_not}"
        return
    try:
        b.cache_key = step_key(
            (b.plan, b.forward, b.example, _outlining(b), sorted(b.regions), b.spec.training)
        )
    except Uncacheable as e:
        b.cache_note = f"not used: {e}"
        return
    cached = step_cache.load(b.spec.name, b.cache_key, b.fake_mode)
    if cached is None:
        b.cache_note = f"miss ({b.cache_key[:12]})"
        return
    b.loaded, b.step_gm = True, cached.step_gm
    if cached.outline is not None:
        b.outline = cached.outline
    b.cache_note = f"hit ({b.cache_key[:12]}): {_nodes(b.step_gm)} nodes"


def _save_step(b: _Build) -> None:
    key = b.cache_key
    if key is None:  # not keyed: the stage is not wanted then (STAGES)
        return
    saved = step_cache.save(
        b.spec.name, key, step_cache.CachedStep(b.step_gm, getattr(b, "outline", None))
    )
    b.cache_note = "saved" if saved else "not saved"


def _assemble(b: _Build) -> None:
    b.step_gm = assemble_step(b.plan, b.forward, b.example, _outlining(b))


def _outlining(b: _Build) -> bool:
    # not tried yet: with activation checkpointing (recompute copies regions) or symbolic sizes,
    config = b.spec.config
    # nor where build() differentiates itself (its backward ops are in the forward graph)
    return (
        config.outline_blocks
        and b.spec.training
        and not b.regions
        and not b.request.dynamic
        and not b.plan.captured.gradient_code.present
        and not b.plan.fp8_state  # nor with the delayed fp8 recipe's state inputs
    )


def _outline(b: _Build) -> None:
    """Repeated blocks as shared subgraphs, on a copy: if outlining fails, the inlined step is
    compiled (and the INFO line says why)."""
    outlined = copy_graph_module(b.step_gm)
    try:
        b.outline = outline_blocks(outlined)
    except Exception as e:  # outlining is an optimisation; the step is correct without it
        b.outline = OutlineResult(left_inline=[f"all ({type(e).__name__}: {e})"])
        return
    b.step_gm = outlined


def _recompute(b: _Build) -> None:
    recomputed = recompute_checkpointed(b.step_gm, b.regions)
    log.info(
        "%s: activation checkpointing recomputes %d ops in %d regions",
        b.spec.name,
        recomputed.copies,
        len(recomputed.regions),
    )


def _compile(b: _Build) -> None:
    config = b.spec.config
    b.compile_detail = f"{_nodes(b.step_gm)} nodes, {config.backend}"
    label = f"{b.spec.name}: compiling the step ({b.compile_detail})"

    def compile_once() -> StepFn:
        options = dict(config.inductor_options)
        return compile_step(b.step_gm, b.example, config.backend, options, b.loaded)

    with CompileProgress(label, show=b.spec.progress and config.backend != "eager"):
        b.compiled, caches = compile_from_cache(b.spec.name, config.backend, compile_once)
    if config.backend == "inductor":  # whether a restart was served from inductor's caches
        b.compile_detail += ", " + (caches or "no cache")


def _nodes(gm: fx.GraphModule) -> int:
    return len(gm.graph.nodes)


def _outline_detail(b: _Build) -> str:
    o = b.outline
    text = f"{_nodes(b.step_gm)} nodes, {o.blocks} blocks, {o.distinct} distinct regions"
    text += f", {o.outlined} regions outlined"
    if o.saves.recomputed:
        text += (
            f"; backwards recompute {o.saves.recomputed} cheap values, the forwards store "
            f"{o.saves.after / 2**20:.1f} MiB instead of {o.saves.before / 2**20:.1f}"
        )
    if o.left_inline:
        text += f"; inline: {', '.join(o.left_inline[:4])}" + (
            " ..." if len(o.left_inline) > 4 else ""
        )
    return text


def _passes_detail(b: _Build) -> str:
    if b.amp is None:
        return f"{_nodes(b.forward)} nodes, AMP off"
    return f"{_nodes(b.forward)} nodes, {b.amp.stats.get('casts', 0)} casts"


STAGES: tuple[Stage, ...] = (
    Stage("capture", _capture, describe=lambda b: f"{_nodes(b.captured.gm)} nodes"),
    Stage("amp_passes", _amp_passes, describe=_passes_detail),
    Stage("plan", _plan),
    Stage("examples", _examples),
    Stage(
        "step_cache",
        _cached_step,
        wanted=lambda b: b.spec.config.step_cache,
        describe=lambda b: b.cache_note,
    ),
    Stage(
        "assemble",
        _assemble,
        wanted=lambda b: not b.loaded,
        describe=lambda b: f"{_nodes(b.step_gm)} nodes",
    ),
    Stage(
        "recompute",
        _recompute,
        wanted=lambda b: bool(b.regions) and b.spec.training and not b.loaded,
        describe=lambda b: f"{_nodes(b.step_gm)} nodes",
    ),
    Stage(
        "outline",
        _outline,
        wanted=lambda b: _outlining(b) and not b.loaded,
        describe=lambda b: _outline_detail(b),
    ),
    Stage(
        "save_step",
        _save_step,
        wanted=lambda b: b.cache_key is not None and not b.loaded,
        describe=lambda b: b.cache_note,
    ),
    Stage("compile", _compile, describe=lambda b: b.compile_detail),
)


def trace_autocast(program: Program) -> AutocastTrace:
    """What torch.autocast does on the program's forward (the precision report's oracle)."""
    root = BuildRoot(program.spec.modules, program.spec.build)
    amp, example = program.amp, program.example_inputs
    if amp is None or example is None:
        raise ValueError("trace_autocast needs a program built with AMP")
    try:
        with _one_build_at_a_time(program.spec.name):
            return autocast_forward(root, example, amp.dtype, program.device)
    except _PASS_THROUGH:
        raise
    except Exception as e:  # as in build_program
        raise stage_error(program.spec, "capture", e) from e
