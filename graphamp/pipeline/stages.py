"""The build's stages, each a function from records to a record.

Every stage reads the ``BuildContext`` (what the runtime asked for, made once before capture;
after it, only its fake mode may change, to the one capture's kept trace ran in) and the
records earlier stages returned, and returns its own: a stage's signature is everything it
reads and makes. ``build.py`` calls them in order, times and logs them, and words what they
raise (``stage_errors.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.fx as fx

from ..backend import compile_step, noted_step, source_keys, step_cache
from ..backend.aot_key import read_note, remembered_key
from ..backend.inductor_cache import compile_from_cache
from ..backend.progress import CompileProgress
from ..backend.step_key import Uncacheable, step_key
from ..capture import (
    BuildRoot,
    capture_forward,
    check_devices,
    check_module_paths,
    checkpointed_paths,
    pinned_paths,
)
from ..errors import ConfigError
from ..passes import DEFAULT_LISTS, AmpContext, pass_settings, run_amp_passes
from ..records.deferred import DeferredGraph
from ..records.guards import BuildRequest
from ..records.inputs import FlatInputs
from ..records.spec import CapturedForward, GraphSpec, PassRecord, StepFn, StepPlan
from ..records.state import SharedState
from ..runner import Runner
from ..runner.host_memory import keep_freed_memory
from ..sharding.fsdp_adopt import refuse_foreign_dtensors
from ..sharding.sharded_params import shard_group
from ..step import (
    OutlineResult,
    StepComponent,
    assemble_step,
    block_specs,
    block_updates_pay,
    build_plan,
    compile_block_kernels,
    component_examples,
    example_inputs,
    outline_blocks,
    outlining_cost_words,
    outlining_pays,
    set_kernel_backend,
)
from ..torchkit.fxutil import copy_graph_module
from ..torchkit.pin_match import PinMatch, resolve_pins
from ..torchkit.shapes import is_symbolic
from .side_compile import SideCompile, compile_noted_kernel
from .side_compile import applies as side_compile_applies
from .tier_up import Made

log = logging.getLogger("graphamp")


@dataclass(frozen=True)
class BuildContext:
    """What every stage of one build may read: the request, made once, before capture; where
    capture kept a trace of a copy of the batch in a fake mode of its own, the build goes on in
    that mode (``on_traced_batch``)."""

    spec: GraphSpec
    inputs: FlatInputs  # the call's real inputs
    state: SharedState
    request: BuildRequest
    # one fake mode for every stage: the batch's symbolic sizes are the same symbols in
    # capture, assembly and the backend, and what they assume of them lands in one ShapeEnv
    fake_mode: Any
    batch: FlatInputs  # ``inputs`` as fake tensors of ``fake_mode`` (some sizes symbolic)
    root: BuildRoot
    process_group: Any = None  # data parallel: the group gradients are averaged over


# -- capture -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Captured:
    """What capture made: build() traced, and the module facts later stages need."""

    forward: CapturedForward
    device: torch.device  # the one device of the modules and the batch
    module_pins: dict[str, str]  # module path -> why it stays fp32 (AMP on)
    regions: frozenset[str]  # activation checkpointing regions
    pass_settings: dict[str, Any]  # the AmpContext fields of passes with settings, checked


def capture(ctx: BuildContext) -> Captured:
    """build() traced, and the module facts the later stages need (checked once, here)."""
    spec, config = ctx.spec, ctx.spec.config
    if config.grad_acc_steps > 1 and not spec.training:
        raise ConfigError(
            f"{spec.name}: gradient accumulation splits a training step into "
            "micro-batches, but the graph has no optimizer"
        )
    refuse_foreign_dtensors(spec.name, ctx.root)
    device = check_devices(spec.name, ctx.root, ctx.inputs)
    traced = ctx.batch
    if config.grad_acc_steps > 1:
        ctx.inputs.check_micro_batches(config.grad_acc_steps, spec.name)
        traced = ctx.batch.micro_batch(config.grad_acc_steps)
    forward = capture_forward(
        ctx.root,
        traced,
        spec.name,
        None,
        config.amp_active,
        ctx.request.lifted,
        ctx.request.lifted_inputs,
        ctx.process_group,  # the gradients build() reads are averaged over it
        may_move=traced is ctx.batch,  # micro-batches: the whole batch's mode is the build's
    )
    pins = {}
    if config.amp_active:
        pins = pinned_paths(
            ctx.root, config.fp32_module_types, config.fp32_module_names, config.amp_dtype
        )
    settings = pass_settings(
        config, device, spec.name, spec.training, partial(check_module_paths, ctx.root)
    )
    regions = checkpointed_paths(
        ctx.root, config.checkpoint_module_types, config.checkpoint_module_names
    )
    return Captured(forward, device, pins, frozenset(regions), settings)


def on_traced_batch(ctx: BuildContext, captured: Captured) -> BuildContext:
    """``ctx`` in the fake mode of the batch capture's kept trace ran on: a symbolic batch is
    traced first on a copy in a mode of its own, and where build() wrote no state that trace is
    the build's (``capture_forward``'s ``may_move``), its symbols those of every later stage."""
    moved = captured.forward.moved_to
    if moved is None:
        return ctx
    mode = next(t.fake_mode for t in moved.tensors if is_symbolic(t))
    return dataclasses.replace(ctx, fake_mode=mode, batch=moved)


# -- the AMP passes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Passed:
    """The forward after the AMP passes, their context, and each pass's code (for dumps)."""

    forward: fx.GraphModule  # the captured forward itself when AMP is off
    amp: AmpContext | None  # None: AMP off
    records: list[PassRecord] = field(default_factory=list)


def amp_passes(ctx: BuildContext, captured: Captured, capture_seconds: float) -> Passed:
    """The AMP passes on a copy of the captured forward (AMP off: the captured forward)."""
    spec, config, forward = ctx.spec, ctx.spec.config, captured.forward
    records = [PassRecord("captured", forward.gm.code, capture_seconds, True)]
    if not config.amp_active:
        return Passed(forward.gm, None, records)
    placeholders = [n.name for n in forward.gm.graph.nodes if n.op == "placeholder"]
    pins = _resolve_pins(spec, ctx.root, forward)
    amp = AmpContext(
        dtype=config.amp_dtype,
        lists=DEFAULT_LISTS.with_overrides(config.list_overrides),
        opt_level=config.amp_opt_level,
        pinned_paths=frozenset(captured.module_pins) | pins.modules,
        pin_reasons=captured.module_pins,
        pinned_nodes=pins.nodes,
        parameters=frozenset(forward.layout.split(placeholders).params),
        user_outputs=forward.num_user_outputs,
        **captured.pass_settings,
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

    passed = run_amp_passes(copy_graph_module(forward.gm), amp, after_pass=record)
    return Passed(passed, amp, records)


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


# -- plan and the step's example inputs -----------------------------------------------------------


def plan(ctx: BuildContext, captured: Captured, passed: Passed) -> StepPlan:
    amp = passed.amp
    return build_plan(
        ctx.spec,
        captured.forward,
        passed.forward,
        [id(p) for p in ctx.root.parameters()],
        list(amp.hoisted) if amp is not None else [],
        list(amp.pass_state) if amp is not None else [],
        ctx.process_group,
        shard_group(ctx.spec.name, ctx.root),
        captured.regions,
    )


def examples(ctx: BuildContext, plan: StepPlan, device: torch.device) -> list[torch.Tensor]:
    """The step's example inputs (fake): what the key, assembly and the backend read."""
    return example_inputs(plan, ctx.root, ctx.state, ctx.batch.tensors, device)


# -- choices made once, after planning ------------------------------------------------------------


@dataclass(frozen=True)
class Choices:
    """What this build does besides assembling and compiling, decided once, after planning."""

    outline: bool  # repeated blocks as shared subgraphs (config.set_outline_blocks)
    # blocks repeated at least this many times updated by one kernel each (0: the update
    # inline; config.set_block_updates)
    block_updates: int
    cache: bool  # the step cache is looked up (and written after a miss)


def side_compile(ctx: BuildContext, choices: Choices, device: torch.device) -> SideCompile | None:
    """A child process for the blocks' update kernels of a cold build that will have them
    (``side_compile.py``): with block updates, kernels noted (the step cache on, inductor),
    CPU, no process group (ranks share the machine's cores)."""
    if not (choices.block_updates and choices.cache):
        return None
    if ctx.spec.config.backend != "inductor" or device.type != "cpu":
        return None
    if ctx.process_group is not None:
        return None
    return SideCompile.spawn(ctx.spec.name)


def outlined_by_default(device: torch.device, grad_acc_steps: int) -> bool:
    """Whether a step is outlined when the user has not said: only where its steady step
    measured as fast outlined as inlined (the 2% rule, docs/usage.md). That is the CPU's plain
    step (benchmarks/outline_cost.py: 1.004-1.022x on four workloads). Not a CUDA step: GPT-2
    124M bf16 on an H200 measured 1.039x, 1.032x and 1.019x the inlined step (GPU rounds 3-5,
    benchmarks/results/h200-round5; 668 kernels a step against 618), too close to 2% to spend
    the step on. Not
    gradient accumulation: 1.024x and 1.027x on the CPU's GPT workloads (``--kind
    accumulated``). Other devices are unmeasured, so inlined."""
    return device.type == "cpu" and grad_acc_steps == 1


# Where the user has not said, blocks repeated at least this often have their updates by one
# kernel call each, on the CPU's plain steps, outlined or inlined. Two equal blocks (ResNet-18's
# first stage) save one block's update at compile time and measured 1.021-1.026x the inlined
# step outlined; 6 and 12 repeats (the GPT workloads, ViT-Ti) 1.004-1.022x outlined
# (outline_cost_block_updates_cpu.md, outline_cost_cpu.md); inlined, where the blocks do
# enough work (step/block_work.py: BLOCK_UPDATE_MIN_FLOPS_PER_BLOCK).
REPEATS_BY_DEFAULT = 3


def choose(ctx: BuildContext, captured: Captured, plan: StepPlan) -> Choices:
    spec, config = ctx.spec, ctx.spec.config
    by_default = outlined_by_default(captured.device, config.grad_acc_steps)
    outline_default = by_default
    if by_default and config.outline_blocks is None and not outlining_pays(captured.forward.gm):
        outline_default = False
        log.info(
            "%s: repeated blocks inlined: %s (config.set_outline_blocks(True) outlines them, "
            "for a faster first call)",
            spec.name,
            outlining_cost_words(captured.forward.gm),
        )
    plain = _plain(ctx, plan)
    wanted = config.outline_blocks if config.outline_blocks is not None else outline_default
    if config.block_updates is None:
        # measured only there, and only where the blocks do enough work (block_work.py)
        pays = by_default and block_updates_pay(captured.forward.gm)
        repeats = REPEATS_BY_DEFAULT if pays else 0
    else:
        repeats = 2 if config.block_updates else 0
    return Choices(wanted and plain, repeats if plain else 0, config.step_cache)


def _plain(ctx: BuildContext, plan: StepPlan) -> bool:
    """Whether the step may be outlined and have block updates: not tried yet with gradient
    code in build() (its backward ops are in the forward graph) or a pass's state inputs."""
    gradient_code = plan.captured.gradient_code.present
    return ctx.spec.training and not gradient_code and not plan.pass_state


def first_choices(
    ctx: BuildContext, plan: StepPlan, choices: Choices, device: torch.device
) -> Choices | None:
    """The choices whose step compiles fastest (blocks outlined, their updates by one kernel
    each), where they are not ``choices`` and the step of ``choices`` may be compiled beside
    training and take over later (``tier_up.py``): the user set neither choice nor asked
    torch for deterministic algorithms (the two steps may differ in the last bits, and when
    the take-over happens depends on the machine); a plain CPU step of inductor's with the
    step cache on; no process group, no recompute (its restart is not made from a note);
    the side compile applies. None otherwise."""
    config = ctx.spec.config
    if config.outline_blocks is not None or config.block_updates is not None:
        return None
    if torch.are_deterministic_algorithms_enabled():
        return None
    if not (choices.cache and config.backend == "inductor" and device.type == "cpu"):
        return None
    if ctx.process_group is not None or plan.recomputes:
        return None
    if not (_plain(ctx, plan) and outlined_by_default(device, config.grad_acc_steps)):
        return None
    first = Choices(True, REPEATS_BY_DEFAULT, True)
    return first if first != choices and side_compile_applies() else None


# -- the step graph: loaded, or assembled (recomputed, outlined) and saved --------------------------


@dataclass(frozen=True)
class StepGraph:
    """The whole step as one FX graph, and how it came to be."""

    graph: DeferredGraph  # a restart's is unpickled when first read (``noted_step.py``)
    loaded: bool = False  # from the step cache: assembly and outlining skipped
    outline: OutlineResult | None = None  # None: not outlined
    key: str | None = None  # the step cache's key it was loaded or saved under
    note: dict | None = None  # loaded and not unpickled: the note it may compile from
    side: SideCompile | None = None  # a child process for the blocks' kernels (side_compile.py)
    tier_up: Any = None  # the chosen step, to take over from this one later (tier_up.py)

    @classmethod
    def of(cls, gm: fx.GraphModule, **kw: Any) -> StepGraph:
        return cls(DeferredGraph.ready(gm), **kw)

    @property
    def gm(self) -> fx.GraphModule:
        return self.graph.gm


@dataclass(frozen=True)
class CacheLookup:
    """The step cache's key for this build, and the step an earlier run saved under it."""

    key: str | None  # None: the step cannot be keyed (note says why)
    step: StepGraph | None  # None: a miss
    note: str  # the step_cache INFO line


def look_up(
    ctx: BuildContext,
    captured: Captured,
    passed: Passed,
    plan: StepPlan,
    example: list,
    choices: Choices,
) -> CacheLookup:
    """The key of everything assembly and outlining read (``backend/step_key.py``), and the
    step saved under it, if any."""
    what = (
        plan,
        passed.forward,
        example,
        choices.outline,
        choices.block_updates,
        sorted(captured.regions),
        ctx.spec.config.backend == "eager",  # other backends' steps are saved with reshapes
    )
    try:
        key = step_key((*what, ctx.spec.training))
    except Uncacheable as e:
        return CacheLookup(None, None, f"not used: {e}")
    deferred = _deferred(ctx, key, plan)
    if deferred is not None:
        return CacheLookup(key, deferred, f"hit ({key[:12]}): {deferred.graph.nodes} nodes")
    cached = step_cache.load(ctx.spec.name, key, ctx.fake_mode)
    if cached is None:
        return CacheLookup(key, None, f"miss ({key[:12]})")
    step = StepGraph.of(cached.step_gm, loaded=True, outline=cached.outline, key=key)
    return CacheLookup(key, step, f"hit ({key[:12]}): {nodes(step.gm)} nodes")


def _deferred(ctx: BuildContext, key: str, plan: StepPlan) -> StepGraph | None:
    """The step under ``key``, authenticated and not unpickled, where the compile may need
    only the note (``noted_step.py``): inductor, static sizes, and nothing that reads the
    graph at every build (checkpointing's count in the report; the blocks' update kernels are
    made from the note's specs)."""
    config = ctx.spec.config
    if config.backend != "inductor" or ctx.request.dynamic:
        return None
    note = read_note(ctx.spec.name, key)
    if plan.recomputes or note is None or not noted_step.usable(note):
        return None
    load = step_cache.load_later(ctx.spec.name, key, ctx.fake_mode)
    if load is None:
        return None
    graph = DeferredGraph(load, note["nodes"])
    return StepGraph(graph, loaded=True, key=key, note=note)


def assemble(plan: StepPlan, passed: Passed, example: list, choices: Choices) -> StepGraph:
    return StepGraph.of(
        assemble_step(plan, passed.forward, example, choices.outline, choices.block_updates)
    )


def outline(step: StepGraph) -> StepGraph:
    """Repeated blocks as shared subgraphs, on a copy: if outlining fails, the inlined step is
    compiled (and the INFO line says why)."""
    outlined = copy_graph_module(step.gm)
    try:
        result = outline_blocks(outlined)
    except Exception as e:  # outlining is an optimisation; the step is correct without it
        failed = OutlineResult(left_inline=[f"all ({type(e).__name__}: {e})"])
        return dataclasses.replace(step, outline=failed)
    return StepGraph.of(outlined, outline=result)


def rewrite(component: StepComponent, plan: StepPlan, step: StepGraph) -> tuple[StepGraph, str]:
    """A step component's rewrite of the assembled step (``StepComponent.rewrite_step``, in
    place on ``step.gm``; the step's node count made again), and its words for the stage's
    INFO line."""
    words = component.rewrite_step(plan, step.gm)
    rewritten = dataclasses.replace(step, graph=DeferredGraph.ready(step.gm))
    return rewritten, f"{nodes(step.gm)} nodes" + (f"; {words}" if words else "")


def save_step(ctx: BuildContext, key: str, step: StepGraph) -> str:
    saved = step_cache.save(ctx.spec.name, key, step_cache.CachedStep(step.gm, step.outline))
    return "saved" if saved else "not saved"


# -- compile, and the Runner around the compiled step -----------------------------------------------


@dataclass(frozen=True)
class Compiled:
    runner: Runner
    detail: str  # what the compile stage's INFO line says besides its seconds


def compile(
    ctx: BuildContext, plan: StepPlan, step: StepGraph, example: list, device: torch.device
) -> Compiled:
    """The backend on the whole step, and the Runner that binds it to the live state."""
    config = ctx.spec.config
    detail = f"{step.graph.nodes} nodes, {config.backend}"
    label = f"{ctx.spec.name}: compiling the step ({detail})"

    saved_key = step.key if config.backend == "inductor" else None
    tries = _Tries(ctx.spec.name, noted=saved_key is not None)

    def compile_once() -> StepFn:
        options = dict(config.inductor_options)
        if step.note is not None and not step.graph.in_memory:
            noted = noted_step.compile_noted(
                ctx.spec.name, step.note, example, ctx.fake_mode, options
            )
            if noted is not None:
                tries.keys.append(f"{REMEMBERED}, {GRAPH_NOT_LOADED}")
                tries.make_kernels(step.note["block_specs"], cached=True)
                return noted
        return _compile_graph(ctx, step, example, options, tries)

    # the step cache on: torch's source hashes kept from the last run, if its files are the same
    sources = source_keys.preset(ctx.spec.name) if saved_key is not None else None
    with CompileProgress(label, show=ctx.spec.progress and config.backend != "eager"):
        compiled, caches = compile_from_cache(ctx.spec.name, config.backend, compile_once)
    if caches:  # inductor's caches were looked up: the hashes were computed (or given)
        source_keys.keep(ctx.spec.name, sources)
    if config.backend == "inductor":
        detail += tries.described(caches)
    if device.type == "cpu" and ctx.spec.keep_cpu_memory:
        keep_freed_memory(ctx.spec.name)
    replay = device.type == "cuda" and config.backend != "eager" and config.cuda_graph is not False
    runner = Runner(
        plan,
        ctx.root,
        ctx.state,
        device,
        compiled,
        cuda_graph_batch=ctx.inputs.tensors if replay else None,
        cuda_graph_sizes=config.cuda_graph_sizes if ctx.request.dynamic else None,
        graph_name=ctx.spec.name,
        component_inputs=component_examples(plan, ctx.state, device),
    )
    return Compiled(runner, detail)


def made_from_note(ctx: BuildContext, key: str, example: list) -> Made:
    """The step a child compiled under ``key`` (``tier_up.py``), made from its note and
    inductor's caches as a restart makes it (its blocks' kernels too), and its graph, read
    from the step cache when first read; None where the note is missing or does not hold this
    process's compile (nothing is compiled here then)."""
    name, options = ctx.spec.name, dict(ctx.spec.config.inductor_options)
    note = read_note(name, key)
    load = step_cache.load_later(name, key, ctx.fake_mode)
    if note is None or not noted_step.usable(note) or load is None:
        return None
    made = noted_step.compile_noted(name, note, example, ctx.fake_mode, options)
    if made is None:
        return None
    compile_block_kernels(note["block_specs"], True, partial(compile_noted_kernel, name))
    return made, DeferredGraph(load, note["nodes"])


def _compile_graph(
    ctx: BuildContext, step: StepGraph, example: list, options: dict, tries: _Tries
) -> StepFn:
    """The step's graph compiled, and its blocks' update kernels made: beside it, in a child
    process, where ``side_compile`` applies."""
    backend = ctx.spec.config.backend
    set_kernel_backend(step.gm, backend)  # the blocks' update kernels: the same
    specs = block_specs(step.gm)
    extra = {"block_specs": specs}  # what a restart compiling from the note makes besides
    beside = step.side
    if beside is not None and not beside.request(ctx.spec.name, specs):
        beside = None  # nothing for it, or asked by a first try already
    try:
        with remembered_key(
            step.gm, step.key if tries.noted else None, ctx.spec.name, extra
        ) as memo:
            compiled = compile_step(step.gm, example, backend, options, step.loaded)
    except BaseException:
        if beside is not None:
            beside.stop()
        raise
    tries.keys.append(REMEMBERED if memo.remembered else "")
    tries.beside = beside is not None and beside.finished(ctx.spec.name)
    # a noted kernel is made from its note where it has one (the child's, or an earlier step's
    # with equal blocks), as a restart makes it
    tries.make_kernels(specs, step.loaded or tries.noted)
    return compiled


@dataclass
class _Tries:
    """What each try of the step's compile did (``compile_from_cache`` may try twice)."""

    graph_name: str
    noted: bool  # the step cache is on: the blocks' kernels are noted as the step is
    kernels: list[tuple[int, float]] = field(default_factory=list)  # block kernels made, seconds
    keys: list[str] = field(default_factory=list)  # how AOTAutograd's key was had ("": hashed)
    beside: bool = False  # the last try's kernels were compiled beside the step (side_compile)

    def make_kernels(self, specs: list[str], cached: bool) -> None:
        start = time.perf_counter()
        noted = partial(compile_noted_kernel, self.graph_name) if self.noted else None
        made = compile_block_kernels(specs, cached, noted)
        self.kernels.append((made, time.perf_counter() - start))

    def described(self, caches: str) -> str:
        """The inductor compile line's end: the last try's kernels, whether a restart was
        served from inductor's caches, and how the key was had."""
        text = ""
        if self.kernels and self.kernels[-1][0]:
            made, seconds = self.kernels[-1]
            text += f", {made} block update kernel{'s' * (made > 1)} in {seconds:.2f} s"
            text += " (compiled beside the step)" if self.beside else ""
        text += ", " + (caches or "no cache")
        if self.keys and self.keys[-1]:
            text += ", " + self.keys[-1]
        return text


REMEMBERED = "AOTAutograd's key remembered"  # the compile line's words (the tests read them)
GRAPH_NOT_LOADED = "the step's graph not loaded"


def nodes(gm: fx.GraphModule) -> int:
    return len(gm.graph.nodes)
