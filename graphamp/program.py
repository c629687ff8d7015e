"""A Program: one compiled step for one input signature, and what it reads and writes per call.

Building one runs the pipeline: capture → AMP passes → step assembly → compile. Running one
gathers the live state tensors (the user's parameters, buffers and optimizer state: they stay
the truth), refreshes the hyperparameter tensors that changed, and calls the compiled step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.autograd.graph import increment_version

from .capture import BuildRoot, CapturedForward, capture_forward
from .compile import CudaGraphStep, compile_step
from .errors import CaptureError, ConfigError
from .optim import GroupPlan, OptimizerPlan, group_flags, init_state, optimizer_kind, state_keys
from .passes import AmpContext, run_amp_passes
from .scaler import warn_about_dtype
from .signature import FlatInputs
from .step import StepPlan, assemble_step
from .validate import dtype_name

if TYPE_CHECKING:
    from .graph import Graph

log = logging.getLogger("graphamp")


@dataclass
class PassRecord:
    """The forward graph's code after one stage, kept for dumps and debug output."""

    name: str
    code: str
    seconds: float
    modified: bool


@dataclass
class ShadowEntry:
    """A persistent low-precision copy of a parameter (see passes/hoist_param_casts.py).

    The compiled step refreshes it together with the parameter. If the parameter changes outside
    the graph (load_state_dict, manual edits, eager steps, another graph), its version counter
    moves and the copy is refreshed before the next call.
    """

    tensor: torch.Tensor
    param: torch.Tensor
    version: int

    def sync(self, param: torch.Tensor) -> None:
        if param is not self.param or param._version != self.version:
            if param is not self.param and param.shape != self.tensor.shape:
                self.tensor = torch.empty_like(param, dtype=self.tensor.dtype)
            with torch.no_grad():
                self.tensor.copy_(param)
            self.param = param
            self.version = param._version


@dataclass
class HyperSlot:
    """One param group's hyperparameters as device tensors, refreshed when the group changes."""

    plan: OptimizerPlan
    group: dict
    tensors: list[torch.Tensor]
    values: tuple

    def sync(self) -> None:
        values = self.plan.hyper_values(self.group)
        if values == self.values:
            return
        for t, v, old in zip(self.tensors, values, self.values):
            if isinstance(v, torch.Tensor):
                t.copy_(v)  # a tensor lr: device copy, no sync
            elif v != old:
                t.fill_(v)  # a kernel argument, no sync
        self.values = values


@dataclass
class Program:
    graph_name: str
    captured: CapturedForward
    forward: fx.GraphModule  # after the AMP passes
    amp: AmpContext | None
    plan: StepPlan
    step_gm: fx.GraphModule
    compiled: Any
    device: torch.device
    param_slots: list[tuple[dict, str]]
    buffer_slots: list[tuple[dict, str]]
    hyper: list[HyperSlot]
    extra_state: list[torch.Tensor]  # counters, scaler state, history
    timings: dict[str, float] = field(default_factory=dict)
    pass_records: list[PassRecord] = field(default_factory=list)
    shadow_slots: list[tuple[tuple[dict, str], ShadowEntry]] = field(default_factory=list)
    opt_state: list[torch.Tensor] | None = None
    calls: int = 0
    example_inputs: FlatInputs | None = None  # meta copies, for the autocast oracle

    def __post_init__(self) -> None:
        # the parameters each call updates in place (fixed per plan): version counters to bump
        self.updated_params = [p for opt in self.plan.optimizers for p in opt.params]

    @property
    def n_state(self) -> int:
        return len(self.plan.layout) - self.captured.num_inputs

    def gather_state(self) -> list[torch.Tensor]:
        if self.opt_state is None:
            self.opt_state = materialize_optimizer_state(self.plan)
        for slot in self.hyper:
            slot.sync()
        for (d, k), entry in self.shadow_slots:
            entry.sync(d[k])
        return [
            *(d[k] for d, k in self.param_slots),
            *(d[k] for d, k in self.buffer_slots),
            *self.opt_state,
            *(t for slot in self.hyper for t in slot.tensors),
            *self.extra_state,
            *(entry.tensor for _, entry in self.shadow_slots),
        ]

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = [*self.gather_state(), *inputs]
        with torch.no_grad():
            outputs = self.compiled(*flat)
        self.calls += 1
        if self.plan.training:
            # In-place updates bump version counters, as eager optimizer steps do: autograd and
            # other graphs sharing these parameters (their shadows) see the change.
            _increment_versions(self.updated_params)
            for (d, k), entry in self.shadow_slots:
                entry.version = d[k]._version
        return list(outputs)

    def invalidate_optimizer_state(self) -> None:
        """The user loaded an optimizer state dict: gather its tensors again at the next call
        (a CUDA graph notices the new addresses and is captured again)."""
        self.opt_state = None


def _increment_versions(tensors: list[torch.Tensor]) -> None:
    try:
        increment_version(tensors)
    except TypeError:  # torch versions whose increment_version takes one tensor
        for t in tensors:
            increment_version(t)


def _slots(root: nn.Module, names: list[str], kind: str) -> list[tuple[dict, str]]:
    """(the dict holding a tensor, its key): a live lookup that follows reassignment and .to()."""
    slots = []
    for name in names:
        prefix, _, attr = name.rpartition(".")
        module = root.get_submodule(prefix) if prefix else root
        slots.append((getattr(module, kind), attr))
    return slots


def build_plan(graph: "Graph", captured: CapturedForward, root: BuildRoot,
               shadows: list[tuple[int, torch.dtype]], direct_use: set[int]) -> StepPlan:
    name = type(graph).__name__
    optimizers = graph._optimizer_slots
    training = bool(optimizers)
    if training and captured.num_losses == 0:
        raise CaptureError(
            f"{name}.build() never calls backward(), but an optimizer is added: call "
            "loss.backward() in build() (or remove add_optimizer for an eval graph)")
    if not training and captured.num_losses:
        where = captured.loss_frames[0]
        raise CaptureError(
            f"{name}.build() calls backward(){' at ' + str(where) if where else ''} but no "
            "optimizer is added: call self.add_optimizer(optimizer) in __init__")
    params = {id(p): i for i, (_, p) in enumerate(root.named_parameters())}
    owner: dict[int, int] = {}
    plans = []
    trainable: list[int] = []
    for k, slot in enumerate(optimizers):
        opt = slot.optimizer
        kind = optimizer_kind(opt)
        groups, updated = [], []
        for group in opt.param_groups:
            positions = []
            for p in group["params"]:
                if id(p) not in params:
                    raise CaptureError(
                        f"{name}: optimizer {k} ({type(opt).__name__}) holds a parameter of shape "
                        f"{tuple(p.shape)} that belongs to no module registered on the graph. "
                        "Register its module as an attribute in __init__ (self.model = model), or "
                        "build the optimizer from that module's parameters")
                i = params[id(p)]
                if i in owner and owner[i] != k:
                    raise CaptureError(
                        f"{name}: parameter {captured.param_names[i]!r} is in optimizers "
                        f"{owner[i]} and {k}; give each parameter to one optimizer")
                owner[i] = k
                if p.requires_grad and i not in captured.unused_params:
                    positions.append(i)
                    updated.append(p)
            flags = group_flags(kind, opt, group)
            groups.append(GroupPlan(positions, flags, state_keys(kind, dict(flags))))
        plans.append(OptimizerPlan(k, opt, kind, groups, slot.clip_max_norm,
                                   slot.clip_norm_type, updated))
        trainable += [i for g in groups for i in g.params]
    if training and not trainable:
        raise CaptureError(f"{name}: no parameter of the optimizers requires grad and reaches "
                           "a loss; there is nothing to train")
    group = None
    if graph.config.data_parallel and training:
        from .distributed import process_group

        group = process_group(graph)
    plan = StepPlan(captured, training, trainable, plans,
                    graph._grad_scaler if training else None, graph._history.capacity,
                    shadows=shadows, direct_use=direct_use, acc_steps=graph.config.grad_acc_steps,
                    process_group=group)
    _fill_layout(plan, captured)
    return plan


def _fill_layout(plan: StepPlan, cap: CapturedForward) -> None:
    layout = plan.layout
    layout.add("params", [f"p_{n}" for n in cap.param_names])
    layout.add("buffers", [f"b_{n}" for n in cap.buffer_names])
    state_names, hyper_names = [], []
    for opt in plan.optimizers:
        position = dict(zip(map(id, opt.params), opt.forward_positions))
        state_names += [f"opt{opt.index}_{key}_{cap.param_names[position[id(p)]]}"
                        for p, key in opt.state_slots()]
        for g, _ in enumerate(opt.groups):
            hyper_names += [f"opt{opt.index}_group{g}_{h}" for h in opt.hyper_names]
    layout.add("opt_state", state_names)
    layout.add("hyper", hyper_names)
    layout.add("counters", [f"opt{opt.index}_applied_steps" for opt in plan.optimizers])
    if plan.scaler is not None:
        layout.add("scaler", ["scaler_scale", "scaler_growth_tracker",
                              "scaler_hysteresis_tracker", "scaler_found_inf"])
    if plan.training:
        layout.add("history", ["history_step", "history_table"])
    if plan.shadows:
        layout.add("shadows", [f"p_{cap.param_names[i]}_{dtype_name(dt)}"
                               for i, dt in plan.shadows])
    layout.add("inputs", [f"in_{n}" for n in cap.input_names])


def materialize_optimizer_state(plan: StepPlan) -> list[torch.Tensor]:
    """The optimizer state tensors in layout order, created in torch's format where missing.

    Existing state (from a checkpoint or earlier eager steps) is kept; a ``step`` on the CPU is
    moved to the parameters' device, where the compiled step can update it without a sync.
    """
    flat = []
    for opt in plan.optimizers:
        for p, key in opt.state_slots():
            state = opt.optimizer.state[p]
            t = state.get(key)
            if t is None:
                t = init_state(opt.kind, key, p)
            elif key == "step":
                t = torch.as_tensor(t).to(device=p.device, dtype=torch.float32)
            elif t.shape != p.shape or t.device != p.device:
                raise CaptureError(
                    f"optimizer {opt.index} state {key!r} has shape {tuple(t.shape)} on "
                    f"{t.device}, its parameter {tuple(p.shape)} on {p.device}: the loaded "
                    "optimizer state does not belong to these parameters")
            state[key] = t
            flat.append(t)
    return flat


def build_program(graph: "Graph", inputs: FlatInputs) -> Program:
    """capture → AMP passes → step assembly → compile, for one input signature."""
    name = type(graph).__name__
    config = graph.config
    timings: dict[str, float] = {}
    root = BuildRoot(graph._registered_modules, graph.build)
    device = graph._check_devices(root, inputs)

    acc = config.grad_acc_steps
    if acc > 1 and not graph._optimizer_slots:
        raise ConfigError(f"{name}: gradient accumulation splits a training step into "
                          "micro-batches, but the graph has no optimizer")
    start = time.perf_counter()
    captured = capture_forward(root, inputs.micro_batch(acc, name) if acc > 1 else inputs, name)
    timings["capture"] = time.perf_counter() - start
    records = [PassRecord("captured", captured.gm.code, timings["capture"], True)]

    forward = captured.gm
    amp = None
    n_params = len(captured.param_names)
    param_placeholders = [n.name for n in captured.gm.graph.nodes if n.op == "placeholder"]
    param_placeholders = param_placeholders[:n_params]
    if config.amp_active:
        amp = AmpContext(dtype=config.amp_dtype,
                         lists=graph._precision_lists(),
                         opt_level=config.amp_opt_level,
                         pinned_paths=graph._pinned_paths(root),
                         parameters=frozenset(param_placeholders))
        forward = _copy_graph_module(captured.gm)

        def record(pass_name: str, gm: fx.GraphModule, modified: bool, seconds: float) -> None:
            # python_code, not recompile: the code text without compiling it
            records.append(PassRecord(pass_name, gm.graph.python_code("self").src, seconds,
                                      modified))
            log.log(logging.DEBUG if graph._debug_level < 2 else logging.INFO,
                    "%s: pass %s %.1f ms%s", name, pass_name, seconds * 1e3,
                    "" if modified else " (no change)")

        start = time.perf_counter()
        forward = run_amp_passes(forward, amp, after_pass=record)
        timings["amp_passes"] = time.perf_counter() - start

    index = {name: i for i, name in enumerate(param_placeholders)}
    shadows = [(index[name], dtype) for name, dtype in (amp.hoisted if amp else [])]
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    direct_use = {i for i in range(n_params) if placeholders[i].users}
    plan = build_plan(graph, captured, root, shadows, direct_use)
    warn_about_dtype(plan.scaler, config.amp_active, config.amp_dtype, name)
    extra = graph._extra_state(plan, device)
    hyper = []
    for opt in plan.optimizers:
        for group in opt.optimizer.param_groups:
            values = opt.hyper_values(group)
            tensors = [torch.as_tensor(v, dtype=torch.float32).to(device).clone().reshape(())
                       for v in values]
            hyper.append(HyperSlot(opt, group, tensors, values))
    param_slots = _slots(root, captured.param_names, "_parameters")
    buffer_slots = _slots(root, captured.buffer_names, "_buffers")
    shadow_slots = [(param_slots[i], graph._shadow(param_slots[i], dtype))
                    for i, dtype in plan.shadows]
    example_state = _example_optimizer_state(plan)
    example = [*(d[k].detach() for d, k in param_slots), *(d[k] for d, k in buffer_slots),
               *example_state, *(t for slot in hyper for t in slot.tensors), *extra,
               *(entry.tensor for _, entry in shadow_slots), *inputs.tensors]

    start = time.perf_counter()
    step_gm = assemble_step(plan, forward, example, name)
    timings["assemble"] = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compile_step(step_gm, example, config.backend, dict(config.inductor_options))
    timings["compile"] = time.perf_counter() - start

    program = Program(name, captured, forward, amp, plan, step_gm, compiled, device, param_slots,
                      buffer_slots, hyper, extra, timings, records, shadow_slots=shadow_slots,
                      example_inputs=inputs.as_meta())
    if _use_cuda_graph(config, device):
        try:
            program.compiled = CudaGraphStep(compiled, program.n_state,
                                             [*program.gather_state(), *inputs.tensors])
        except Exception as e:  # noqa: BLE001 - fall back, and say why
            log.warning("%s: CUDA graph capture failed, running without it: %s: %s", name,
                        type(e).__name__, e)
            program.compiled = compiled
    return program


def _use_cuda_graph(config, device: torch.device) -> bool:
    if device.type != "cuda" or config.backend == "eager":
        return False
    return config.cuda_graph is not False


def _example_optimizer_state(plan: StepPlan) -> list[torch.Tensor]:
    """Tensors shaped like the optimizer state, for tracing and compiling; nothing installed."""
    out = []
    for opt in plan.optimizers:
        for p, key in opt.state_slots():
            existing = opt.optimizer.state.get(p, {}).get(key)
            if isinstance(existing, torch.Tensor) and key != "step":
                out.append(existing)
            else:
                out.append(init_state(opt.kind, key, p))
    return out


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose nodes the AMP passes can rewrite without touching the captured graph."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, graph)
