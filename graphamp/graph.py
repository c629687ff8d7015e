"""graphamp.Graph: write the training step once in build(); call it like a function.

The first call for an input signature captures build(), runs the AMP passes, assembles the whole
step (forward, backward, grad scaler, clipping, optimizer) and compiles it; later calls with the
same signature only run it. See DESIGN.md for the pipeline.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .capture import BuildRoot
from .config import GraphConfig
from .errors import ConfigError, GraphDefinitionError, InputError
from .validate import check_choice
from .history import TrainingHistory
from .optim import optimizer_kind, validate_clip
from .passes.lists import DEFAULT_LISTS, PrecisionLists
from .program import Program, build_program
from .scaler import GradScaler, as_graphamp_scaler
from .signature import check_arity, flatten_inputs
from .step import StepPlan

log = logging.getLogger("graphamp")
_READY = "_graphamp_ready"


@dataclass
class OptimizerSlot:
    optimizer: torch.optim.Optimizer
    lr_sch: Any
    clip_max_norm: float | None
    clip_norm_type: float

    def structure(self) -> tuple:
        groups = []
        for g in self.optimizer.param_groups:
            groups.append((len(g["params"]), tuple(p.requires_grad for p in g["params"]),
                           g.get("momentum", 0) != 0, g.get("dampening", 0) != 0,
                           bool(g.get("nesterov")), g.get("weight_decay", 0) != 0,
                           bool(g.get("amsgrad")), bool(g.get("maximize"))))
        return (type(self.optimizer), tuple(groups), self.clip_max_norm, self.clip_norm_type)


class Graph:
    """Subclass it, register modules and optimizers in __init__, write build().

    ::

        class TrainGraph(graphamp.Graph):
            def __init__(self):
                super().__init__()
                self.model = model
                self.loss_fn = nn.CrossEntropyLoss()
                self.add_optimizer(opt)
                self.config.enable_amp(True)
                self.set_grad_scaler(graphamp.GradScaler(init_scale=3000))

            def build(self, x, y):
                loss = self.loss_fn(self.model(x), y)
                loss.backward()
                return loss
    """

    def __init__(self) -> None:
        d = self.__dict__
        d["_registered_modules"] = OrderedDict()
        d["_optimizer_slots"] = []
        d["config"] = GraphConfig()
        d["_grad_scaler"] = None
        d["_programs"] = OrderedDict()
        d["_history"] = TrainingHistory()
        d["_counters"] = {}
        d["_shadows"] = {}
        d["_debug_level"] = 0
        d["_step_count"] = 0
        d["_last_program"] = None
        d["_module_list"] = None
        d[_READY] = True

    # -- registration ---------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if _READY not in self.__dict__:
            raise GraphDefinitionError(
                f"{type(self).__name__}.__init__ sets {name!r} before calling "
                "super().__init__(); call super().__init__() first")
        modules = self.__dict__["_registered_modules"]
        ddp = getattr(nn.parallel, "DistributedDataParallel", None)
        if ddp is not None and isinstance(value, ddp):
            # graphamp all-reduces inside its own step: keep the wrapped module, run data
            # parallel over DDP's process group (DDP's hooks would not run in a graph anyway)
            log.info("%s.%s is DistributedDataParallel: graphamp trains its module with "
                     "config.enable_data_parallel over the same process group",
                     type(self).__name__, name)
            self.__dict__["config"].enable_data_parallel(process_group=value.process_group)
            value = value.module
        if isinstance(value, nn.Module):
            modules[name] = value
        elif name in modules:
            del modules[name]
        self.__dict__["_module_list"] = None
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails.
        if _READY not in self.__dict__:
            raise GraphDefinitionError(
                f"{type(self).__name__} was used before Graph.__init__ ran: call "
                "super().__init__() at the start of __init__")
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")

    def add_optimizer(self, optimizer: torch.optim.Optimizer, *, lr_sch: Any = None,
                      clip_grad_max_norm: float | None = None,
                      clip_grad_norm_type: float = 2.0) -> None:
        """Update ``optimizer``'s parameters inside the step; ``lr_sch.step()`` after each call.

        ``clip_grad_max_norm`` clips this optimizer's gradients (after unscaling) to that total
        norm of type ``clip_grad_norm_type``, as ``torch.nn.utils.clip_grad_norm_`` does.
        """
        self._check_ready()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"add_optimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
        optimizer_kind(optimizer)  # raises for unsupported optimizers, here and now
        if any(s.optimizer is optimizer for s in self._optimizer_slots):
            raise ConfigError("this optimizer is already added to the graph")
        if lr_sch is not None and getattr(lr_sch, "optimizer", None) is not optimizer:
            raise ConfigError("lr_sch must be a learning-rate scheduler of this optimizer")
        max_norm, norm_type = validate_clip(clip_grad_max_norm, clip_grad_norm_type)
        self._optimizer_slots.append(OptimizerSlot(optimizer, lr_sch, max_norm, norm_type))
        _silence_scheduler_order_warning(optimizer)
        hook = getattr(optimizer, "register_load_state_dict_post_hook", None)
        if hook is not None:
            hook(lambda opt: self._optimizer_state_loaded())

    def set_grad_scaler(self, scaler: Any) -> None:
        """Scale the loss inside the step: a graphamp.GradScaler / StaticGradScaler, or a
        torch.amp.GradScaler whose settings and state graphamp takes over."""
        self._check_ready()
        self.__dict__["_grad_scaler"] = as_graphamp_scaler(scaler)
        self._programs.clear()

    @property
    def grad_scaler(self) -> GradScaler | None:
        """The scaler in use (device tensors ``scale`` and ``found_inf``; no sync to read)."""
        return self._grad_scaler

    @property
    def history(self) -> TrainingHistory:
        """Per-step rows written on the device: ``g.history.fetch()`` returns them."""
        return self._history

    def build(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define build(self, ...): the training step, written "
            "once (forward, loss, loss.backward(), return what you want back)")

    # -- running --------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check_ready()
        inputs = flatten_inputs(args, kwargs)
        key = (inputs.signature, self._structure_key())
        program = self._programs.get(key)
        if program is None:
            program = self._compile(inputs, key, args, kwargs)
        else:
            self._programs.move_to_end(key)
        outputs = program.run(inputs.tensors)
        self.__dict__["_step_count"] += 1
        self.__dict__["_last_program"] = program
        for slot in self._optimizer_slots:
            if slot.lr_sch is not None:
                slot.lr_sch.step()
        return program.captured.unflatten_outputs(outputs)

    def _compile(self, inputs, key, args, kwargs) -> Program:
        name = type(self).__name__
        check_arity(self.build, args, kwargs, name)
        if self._programs:
            log.info("%s: new input signature (%s): capturing and compiling again", name,
                     inputs.signature.describe())
        if self.config.data_parallel:
            from .distributed import build_on_every_rank

            program = build_on_every_rank(self, inputs)
        else:
            program = build_program(self, inputs)
        self._programs[key] = program
        while len(self._programs) > self.config.max_cached_graphs:
            dropped, _ = self._programs.popitem(last=False)
            log.info("%s: dropped the least recently used compiled step (cache holds %d)", name,
                     self.config.max_cached_graphs)
        self._log_summary(program)
        return program

    def _structure_key(self) -> tuple:
        modules = self._module_list
        if modules is None:
            modules = [m for top in self._registered_modules.values() for m in top.modules()]
            self.__dict__["_module_list"] = modules
        scaler = self._grad_scaler
        return (
            tuple(m.training for m in modules),
            tuple(slot.structure() for slot in self._optimizer_slots),
            self.config.snapshot(),
            scaler.settings() if scaler is not None else None,
        )

    # -- helpers for program building -----------------------------------------------------------
    def _check_ready(self) -> None:
        if _READY not in self.__dict__:
            raise GraphDefinitionError(
                f"{type(self).__name__}.__init__ must call super().__init__()")

    def _check_devices(self, root: BuildRoot, inputs) -> torch.device:
        devices = {t.device for t in root.parameters()} | {t.device for t in root.buffers()}
        name = type(self).__name__
        if len(devices) > 1:
            raise InputError(
                f"{name}: the registered modules have tensors on {sorted(map(str, devices))}; "
                "a Graph runs on one device: move them all (model.to(device))")
        device = next(iter(devices)) if devices else None
        for i, t in enumerate(inputs.tensors):
            if device is None:
                device = t.device
            if t.device != device:
                raise InputError(
                    f"{name}(...): input tensor {i} is on {t.device} but the graph runs on "
                    f"{device}; move the batch there (x.to({str(device)!r}))")
        return device or torch.device("cpu")

    def _precision_lists(self) -> PrecisionLists:
        return DEFAULT_LISTS.with_overrides(self.config.list_overrides)

    def _pinned_paths(self, root: BuildRoot) -> frozenset[str]:
        paths = set()
        names = dict(root.named_modules())
        for wanted in self.config.fp32_module_names:
            if wanted not in names:
                close = [n for n in names if n and n.split(".")[-1] == wanted.split(".")[-1]]
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"pin_fp32({wanted!r}): no registered module has that path{hint} (paths "
                    "start at the Graph's attributes, e.g. 'model.head')")
        for path, module in names.items():
            if not path:
                continue
            if isinstance(module, self.config.fp32_module_types) or any(
                    path == w or path.startswith(w + ".") for w in self.config.fp32_module_names):
                paths.add(path)
        return frozenset(paths)

    def _extra_state(self, plan: StepPlan, device: torch.device) -> list[torch.Tensor]:
        """Counters, scaler state and history: the graph's own state, created once per device."""
        out = []
        for opt in plan.optimizers:
            counter = self._counters.get(opt.index)
            if counter is None or counter.device != device:
                started = any(opt.optimizer.state.get(p) for p in opt.params)
                counter = torch.full((), int(started), dtype=torch.int64, device=device)
                self._counters[opt.index] = counter
            out.append(counter)
        if plan.scaler is not None:
            plan.scaler._materialize(device)
            out += plan.scaler.state_tensors()
        if plan.training:
            out += self._history.materialize(device)
        return out

    def _shadow(self, slot: tuple[dict, str], dtype: torch.dtype):
        """The graph's low-precision copy of a parameter (shared by all its compiled steps)."""
        from .program import ShadowEntry

        param = slot[0][slot[1]]
        key = (id(param), dtype)
        entry = self._shadows.get(key)
        if entry is None or entry.param is not param:
            # Convolution weights on CUDA are kept channels-last: cuDNN's fast kernels are NHWC,
            # and a copy in that layout saves a transpose in every forward and backward conv.
            layout = (torch.channels_last if param.dim() == 4 and param.is_cuda
                      else torch.contiguous_format)
            with torch.no_grad():
                shadow = param.detach().to(dtype=dtype, memory_format=layout)
            entry = ShadowEntry(shadow, param, param._version)
            self._shadows[key] = entry
        return entry

    def _optimizer_state_loaded(self) -> None:
        for program in self._programs.values():
            program.invalidate_optimizer_state()

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The graph's own state: step count, grad scaler, optimizer step counters, history.

        Save it beside ``model.state_dict()`` and ``optimizer.state_dict()``; all three load with
        ``torch.load(..., weights_only=True)``.
        """
        scaler = self._grad_scaler
        return {
            "step": self._step_count,
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
            "optimizer_steps": {k: int(v.item()) for k, v in self._counters.items()},
            "history": self._history.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"step", "grad_scaler", "optimizer_steps", "history"} - set(state)
        if missing:
            raise ConfigError(f"not a graphamp Graph state dict: it lacks {sorted(missing)}")
        if state["grad_scaler"] is not None:
            if self._grad_scaler is None:
                raise ConfigError("the saved state has grad-scaler state but this graph has no "
                                  "scaler: call set_grad_scaler(...) before load_state_dict")
            self._grad_scaler.load_state_dict(state["grad_scaler"])
        self.__dict__["_step_count"] = int(state["step"])
        for k, v in state["optimizer_steps"].items():
            k = int(k)
            if k in self._counters:
                self._counters[k].fill_(int(v))
            else:
                device = _first_param_device(self._optimizer_slots, k)
                self._counters[k] = torch.full((), int(v), dtype=torch.int64, device=device)
        self._history.load_state_dict(state["history"])

    @property
    def step_count(self) -> int:
        """How many times the graph was called (overflow-skipped steps included)."""
        return self._step_count

    # -- inspection -----------------------------------------------------------------------------
    def debug(self, v_level: int = 1) -> None:
        """0 quiet, 1 capture/compile summary, 2 each pass, 3 each node's precision decision."""
        check_choice("debug level", v_level, (0, 1, 2, 3))
        self.__dict__["_debug_level"] = v_level
        from .report import configure_logging

        configure_logging(v_level)

    def _log_summary(self, program: Program) -> None:
        from .report import log_program_summary

        log_program_summary(self, program)

    def precision_report(self, *, with_autocast: bool = True):
        """The precision decision for every compute op of the last compiled step."""
        from .report import precision_report

        return precision_report(self, self._require_program(), with_autocast=with_autocast)

    def dump(self, path: str) -> str:
        """Write per-pass graphs, precision.csv, graph.dot (.svg) and report.html under path."""
        from .dump import dump_program

        return dump_program(self, self._require_program(), path)

    def _require_program(self) -> Program:
        if self._last_program is None:
            raise RuntimeError(f"{type(self).__name__} has not run yet: call it once "
                               "(g(x, y)) so there is a captured graph to inspect")
        return self._last_program

    def __repr__(self) -> str:
        from .printing import graph_repr

        return graph_repr(self)


def _silence_scheduler_order_warning(optimizer: torch.optim.Optimizer) -> None:
    """LR schedulers warn when step() runs before optimizer.step(); graphamp steps the optimizer
    inside the compiled program, so mark it as stepped for them."""
    optimizer._opt_called = True  # noqa: SLF001 - the flag torch's schedulers check


def _first_param_device(slots: list[OptimizerSlot], k: int) -> torch.device:
    if k < len(slots):
        for group in slots[k].optimizer.param_groups:
            for p in group["params"]:
                return p.device
    return torch.device("cpu")
