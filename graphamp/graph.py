"""graphamp.Graph: write the training step once in build(); call it like a function.

The Graph keeps what the user registered, the cache of compiled steps (one per input
signature), its own state (scaler, counters, history) and the inspection entry points. The
first call for a signature hands a GraphSpec to ``pipeline.build_program``; later calls only run
the cached step. ``docs/architecture.md`` describes the stages.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import OrderedDict
from typing import Any

import torch
import torch.nn as nn

from . import pipeline
from .config import GraphConfig
from .errors import ConfigError, GraphDefinitionError
from .forensics.autofix import Autofix
from .forensics.reports import OverflowReport, RangeReport
from .inspect.dump import dump_program
from .inspect.printing import graph_repr
from .inspect.report import (
    PrecisionReport,
    configure_logging,
    log_program_summary,
    precision_report,
)
from .records.history import TrainingHistory
from .records.inputs import FlatInputs, check_arity, flatten_inputs
from .records.optimizers import optimizer_kind, validate_clip
from .records.pins import AmpPin
from .records.probes import OverflowEvent
from .records.spec import CompiledStep, GraphSpec, OptimizerSlot, Program
from .records.state import SharedState
from .records.validate import check_choice, check_int
from .runtime import ambient, schedulers
from .runtime.cache_key import StructureKey, describe_change
from .runtime.interrupts import hold_interrupts, release_interrupts
from .runtime.torch_scaler import as_graphamp_scaler
from .scaler import GradScaler

log = logging.getLogger("graphamp")
_READY = "_graphamp_ready"
_RECOMPILES_BEFORE_WARNING = 4
_building = threading.local()  # .name: the Graph whose build() is being captured in this thread


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
        d["_programs"] = OrderedDict()  # structure key -> Program, least recently used first
        d["_state"] = SharedState(TrainingHistory())
        d["_debug_level"] = 0
        d["_step_count"] = 0
        d["_autofix"] = Autofix()
        d["_structure"] = StructureKey()
        d["_last_key"] = None
        d["_lock"] = threading.RLock()  # one call at a time: a Graph is one training loop
        d["_warned_numbers"] = False
        d[_READY] = True

    # -- registration ---------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if _READY not in self.__dict__:
            raise GraphDefinitionError(
                f"{type(self).__name__}.__init__ sets {name!r} before calling "
                "super().__init__(); call super().__init__() first"
            )
        modules = self.__dict__["_registered_modules"]
        ddp = getattr(nn.parallel, "DistributedDataParallel", None)
        if ddp is not None and isinstance(value, ddp):
            # graphamp all-reduces inside its own step: keep the wrapped module, run data
            # parallel over DDP's process group (DDP's hooks would not run in a graph anyway)
            log.info(
                "%s.%s is DistributedDataParallel: graphamp trains its module with "
                "config.enable_data_parallel over the same process group",
                type(self).__name__,
                name,
            )
            self.__dict__["config"].enable_data_parallel(process_group=value.process_group)
            value = value.module
        value = _unwrapped(type(self).__name__, name, value)
        if isinstance(value, nn.Module):
            modules[name] = value
        elif name in modules:
            del modules[name]
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails. copy and pickle look up dunders on an instance
        # whose __init__ never ran: those are plain missing attributes, not a user's mistake.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if _READY not in self.__dict__:
            raise GraphDefinitionError(
                f"{type(self).__name__} was used before Graph.__init__ ran: call "
                "super().__init__() at the start of __init__"
            )
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise GraphDefinitionError(
            f"a {type(self).__name__} cannot be pickled or saved with torch.save: it holds "
            "compiled programs and your live model and optimizer. Save g.state_dict() beside "
            "model.state_dict() and optimizer.state_dict(), and load them into a new "
            f"{type(self).__name__}() with g.load_state_dict(...)"
        )

    def __deepcopy__(self, memo: dict) -> Any:
        raise GraphDefinitionError(
            f"copy.deepcopy of a {type(self).__name__} is not supported: it holds compiled "
            "programs bound to your model's tensors. Copy the model and optimizer, build a new "
            f"{type(self).__name__}() over the copies, and copy the graph's own state with "
            "new_graph.load_state_dict(g.state_dict())"
        )

    def __copy__(self) -> Any:
        return self.__deepcopy__({})

    def add_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        lr_sch: Any = None,
        clip_grad_max_norm: float | None = None,
        clip_grad_norm_type: float = 2.0,
    ) -> None:
        """Update ``optimizer``'s parameters inside the step; ``lr_sch.step()`` after each call.

        ``clip_grad_max_norm`` clips this optimizer's gradients (after unscaling) to that total
        norm of type ``clip_grad_norm_type``, as ``torch.nn.utils.clip_grad_norm_`` does.
        """
        self._check_ready()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"add_optimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        optimizer_kind(optimizer)  # raises for unsupported optimizers, here and now
        if any(s.optimizer is optimizer for s in self._optimizer_slots):
            raise ConfigError("this optimizer is already added to the graph")
        if isinstance(lr_sch, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError(
                "ReduceLROnPlateau cannot be passed as lr_sch: its step() needs the metric, "
                "which graphamp does not have. Leave lr_sch out and call sch.step(metric) "
                "yourself after g(...), outside the Graph; the lr it sets is a graph input, so "
                "the next call uses it without recompiling"
            )
        if lr_sch is not None and getattr(lr_sch, "optimizer", None) is not optimizer:
            raise ConfigError("lr_sch must be a learning-rate scheduler of this optimizer")
        max_norm, norm_type = validate_clip(clip_grad_max_norm, clip_grad_norm_type)
        self._optimizer_slots.append(OptimizerSlot(optimizer, lr_sch, max_norm, norm_type))
        schedulers.silence_order_warning(optimizer)
        hook = getattr(optimizer, "register_load_state_dict_post_hook", None)
        if hook is not None:
            hook(lambda opt: self._optimizer_state_loaded())

    def set_grad_scaler(self, scaler: Any) -> None:
        """Scale the loss inside the step: a graphamp.GradScaler / StaticGradScaler, or a
        torch.amp.GradScaler, which graphamp runs inside the step while that object stays the
        truth (its get_scale, state_dict and load_state_dict stay current). A disabled scaler
        (``enabled=False``) or None means no loss scaling, as in torch."""
        self._check_ready()
        self.__dict__["_grad_scaler"] = None if scaler is None else as_graphamp_scaler(scaler)
        self._programs.clear()  # their steps read the previous scaler's state tensors

    @property
    def grad_scaler(self) -> GradScaler | None:
        """The scaler in use (device tensors ``scale`` and ``found_inf``; no sync to read)."""
        return self._grad_scaler

    @property
    def history(self) -> TrainingHistory:
        """Per-step rows written on the device: ``g.history.fetch()`` returns them."""
        return self._state.history

    def build(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define build(self, ...): the training step, written "
            "once (forward, loss, loss.backward(), return what you want back)"
        )

    # -- running --------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check_ready()
        outer = getattr(_building, "name", None)
        if outer is not None:
            raise GraphDefinitionError(
                f"{type(self).__name__} was called inside {outer}.build(): a Graph is a whole "
                "training step and cannot be part of another one's capture. Call the modules "
                f"directly in {outer}.build() (register them on {outer}), or call "
                f"{type(self).__name__} outside it"
            )
        with self._lock:
            neutral = ambient.neutral_modes()  # an ambient autocast or inference mode
            if neutral is None:
                return self._call(args, kwargs)
            with neutral:
                return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        inputs = flatten_inputs(args, kwargs)
        key = (
            inputs.signature,
            self._structure(
                self._registered_modules,
                self._optimizer_slots,
                self.config.snapshot(),
                self._grad_scaler,
                ambient.mode_key(),
            ),
        )
        program = self._programs.get(key)
        if program is None:
            program = self._compile(inputs, key, args, kwargs)
        else:
            self._programs.move_to_end(key)
        self.__dict__["_last_key"] = key
        return program.captured.unflatten_outputs(self._step(program, inputs))

    def _step(self, program: Program, inputs: FlatInputs) -> list[torch.Tensor]:
        """One step as a transaction: whatever raises, parameters, optimizer state, scaler,
        counters, history and schedulers are all from before the step or all from after it.

        The step's inputs (this step's learning rates included) are gathered first. Then,
        with Ctrl-C held back (interrupts.py): the schedulers step (snapshotted first), the
        bookkeeping is recorded, and the compiled step runs, last, as the one thing that cannot
        be undone. If anything before it fails, the rest is undone. With overflow tracing the
        compiled step writes its overflow record on the device with the rest of the state;
        what the host then reads of it (``_watch_overflows``) happens after the step is
        committed, still with Ctrl-C held, so the host's list of overflows and the device
        count it has read up to move together."""
        runner = program.runner
        flat = runner.gather(inputs.tensors)
        stepping = [s.lr_sch for s in self._optimizer_slots if s.lr_sch is not None]
        saved = [schedulers.snapshot(sch) for sch in stepping]
        undo = None
        held = hold_interrupts()
        try:
            try:
                for sch in stepping:
                    sch.step()  # sets the next step's lr; this step's is already gathered
                undo = runner.record_step()
                self.__dict__["_step_count"] += 1
                outputs = runner.execute(flat)
            except BaseException:
                if undo is not None:
                    undo()
                    self.__dict__["_step_count"] -= 1
                for snapshot in saved:
                    schedulers.restore(snapshot)
                raise
            # committed: from here on nothing undoes the step
            if runner.forensics is not None:
                self._watch_overflows(program)
        finally:
            if held:
                release_interrupts()  # a Ctrl-C that arrived meanwhile is raised here
        return outputs

    def _compile(self, inputs: FlatInputs, key: tuple, args: tuple, kwargs: dict) -> Program:
        name = type(self).__name__
        check_arity(self.build, args, kwargs, name)
        self._log_why_rebuilt(key)
        self._warn_about_changing_numbers(inputs)
        _building.name = name
        try:
            with ambient.capture_modes():
                program = pipeline.build_program(self._spec(), inputs, self._state)
        finally:
            _building.name = None
        self._programs[key] = program
        while len(self._programs) > self.config.max_cached_graphs:
            _, dropped = self._programs.popitem(last=False)
            if dropped.runner.forensics is not None:
                self._read_overflows(dropped)  # its device record goes with it
            log.info(
                "%s: dropped the least recently used compiled step (cache holds %d)",
                name,
                self.config.max_cached_graphs,
            )
        log_program_summary(program)
        return program

    def _spec(self) -> GraphSpec:
        """What the pipeline may read of this Graph, as of now."""
        scaler = self._grad_scaler
        return GraphSpec(
            type(self).__name__,
            tuple(self._registered_modules.items()),
            self.build,
            tuple(self._optimizer_slots),
            scaler if scaler is not None and scaler.enabled else None,
            self.config.snapshot(),
            self._state.history.capacity,
            self._debug_level,
        )

    def _warn_about_changing_numbers(self, inputs: FlatInputs) -> None:
        """A Python number among g(...)'s arguments is baked into the compiled step: one that
        changes every call compiles every call. Say so once, naming it, as torch.compile's
        recompile limit does."""
        sig = inputs.signature
        same_tensors = [
            s
            for s, _ in self._programs
            if s.structure == sig.structure
            and s.tensors == sig.tensors
            and s.constants != sig.constants
        ]
        if len(same_tensors) + 1 < _RECOMPILES_BEFORE_WARNING or self._warned_numbers:
            return
        names = inputs.leaf_names(self.build)
        changing = sorted(
            {
                names[i][0]
                for s in same_tensors
                for i, (a, b) in enumerate(zip(s.constants, sig.constants))
                if a != b
            }
        )
        self.__dict__["_warned_numbers"] = True
        warnings.warn(
            f"{type(self).__name__}: the Python number argument(s) {', '.join(changing)} of "
            f"g(...) took {len(same_tensors) + 1} different values, each compiling a new step "
            "(numbers are baked into the graph). Pass them as tensors (torch.tensor(value)) so "
            "one compiled step serves every value",
            stacklevel=4,
        )

    def _log_why_rebuilt(self, key: tuple) -> None:
        last = self._last_key
        if last is None:
            return
        signature, structure = key
        if structure == last[1]:
            log.info(
                "%s: new input signature (%s): capturing and compiling again",
                type(self).__name__,
                signature.describe(),
            )
        else:
            log.info(
                "%s: %s: capturing and compiling again",
                type(self).__name__,
                describe_change(last[1], structure),
            )

    def _check_ready(self) -> None:
        if _READY not in self.__dict__:
            raise GraphDefinitionError(
                f"{type(self).__name__}.__init__ must call super().__init__()"
            )

    def _optimizer_state_loaded(self) -> None:
        for program in self._programs.values():
            program.runner.invalidate_optimizer_state()

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The graph's own state: step count, grad scaler, optimizer step counters, history.

        Save it beside ``model.state_dict()`` and ``optimizer.state_dict()``; all three load with
        ``torch.load(..., weights_only=True)``.
        """
        scaler = self._grad_scaler
        self._read_all_overflows()
        last = next(reversed(self._programs.values())) if self._programs else None
        ranges = (
            last.runner.forensics.range_rows()
            if last is not None and last.runner.forensics is not None
            else []
        )
        return {
            "step": self._step_count,
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
            "optimizer_steps": {k: int(v.item()) for k, v in self._state.counters.items()},
            "history": self._state.history.state_dict(),  # with the overflow events
            "amp_pins": [pin.to_dict() for pin in self.config.amp_pins],
            "ranges": [row.to_dict() for row in ranges],  # for `python -m graphamp plot`
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` saved. Every part is checked before anything changes: a bad
        state raises ConfigError and leaves the graph exactly as it was."""
        if not isinstance(state, dict):
            raise ConfigError(f"a Graph state dict is a dict, got {type(state).__name__}")
        missing = {"step", "grad_scaler", "optimizer_steps", "history"} - set(state)
        if missing:
            raise ConfigError(f"not a graphamp Graph state dict: it lacks {sorted(missing)}")
        step = check_int("the saved step", state["step"], at_least=0)
        scaler = self._grad_scaler
        if state["grad_scaler"] is not None and scaler is None:
            raise ConfigError(
                "the saved state has grad-scaler state but this graph has no "
                "scaler: call set_grad_scaler(...) before load_state_dict"
            )
        if state["grad_scaler"] is not None and scaler.enabled:
            scaler.check_state_dict(state["grad_scaler"])
        counters = _checked_counters(state["optimizer_steps"], len(self._optimizer_slots))
        self._state.history.check_state_dict(state["history"])
        # states saved before pins existed have no "amp_pins"; "ranges" are not loaded (they
        # belong to the compiled step that measured them)
        pins = _checked_pins(state.get("amp_pins", ()))
        # everything checked: now apply
        if state["grad_scaler"] is not None:
            scaler.load_state_dict(state["grad_scaler"])
        self.__dict__["_step_count"] = step
        for k, v in counters.items():
            if k in self._state.counters:
                self._state.counters[k].fill_(v)
            else:
                device = _first_param_device(self._optimizer_slots, k)
                self._state.counters[k] = torch.full((), v, dtype=torch.int64, device=device)
        self._state.history.load_state_dict(state["history"])
        if pins:
            self.config.pin_fp32(*pins)

    # -- overflow forensics ---------------------------------------------------------------------
    def overflow_report(self) -> OverflowReport:
        """Which node first produced a non-finite value on each overflowing step: its op, dtype,
        module, source line and the largest finite magnitude at its inputs (one device sync).
        Needs ``config.enable_overflow_tracing()``."""
        if not self.config.overflow_tracing:
            raise ConfigError(
                f"{type(self).__name__}: overflow tracing is off; call "
                "g.config.enable_overflow_tracing() (the next call rebuilds the step with it)"
            )
        self._read_all_overflows()
        history = self._state.history
        return OverflowReport(
            type(self).__name__,
            len(history.overflows) + history.overflows_lost,
            list(history.overflows),
            history.overflows_lost,
        )

    def range_report(self) -> RangeReport:
        """The largest magnitude each low-precision value and its gradient reached so far, and
        the headroom left to the dtype's largest number (the last compiled step; one sync)."""
        program = self._require_program()
        if program.runner.forensics is None:
            raise ConfigError(
                f"{type(self).__name__}: ranges are measured with overflow tracing; call "
                "g.config.enable_overflow_tracing() (the next call rebuilds the step with it)"
            )
        return RangeReport(type(self).__name__, program.runner.forensics.range_rows())

    def _watch_overflows(self, program: Program) -> None:
        """Autofix and debug logging act on each overflow soon after it happens: poll the
        device's overflow count without waiting, and read the record (one sync) only when it
        moved. Without either, nothing is read until the user asks."""
        forensics = program.runner.forensics
        if forensics is None or (self.config.autofix is None and self._debug_level < 1):
            return
        count = forensics.poll()  # CUDA: as of the step before, whose copy has landed
        forensics.start_poll()  # queue this step's count behind it (CUDA; no wait)
        if count is None or count <= forensics.analysed:
            return
        events = self._read_overflows(program)
        if program.spec.config.amp_pins == self.config.amp_pins:  # not a step built before a pin
            self._autofix.consider(type(self).__name__, events, self.config)

    def _read_overflows(self, program: Program) -> list[OverflowEvent]:
        if program.runner.forensics is None:  # traced without overflow tracing
            return []
        events, lost = program.runner.forensics.read_new()
        self._state.history.add_overflows(events, lost)
        for event in events:
            log.info("%s: overflow at %s", type(self).__name__, event.describe())
        return events

    def _read_all_overflows(self) -> None:
        for program in self._programs.values():
            if program.runner.forensics is not None:
                self._read_overflows(program)

    @property
    def step_count(self) -> int:
        """How many times the graph was called (overflow-skipped steps included)."""
        return self._step_count

    # -- inspection -----------------------------------------------------------------------------
    def debug(self, v_level: int = 1) -> None:
        """0 quiet, 1 capture/compile summary, 2 each pass, 3 each node's precision decision."""
        self.__dict__["_debug_level"] = check_choice("debug level", v_level, (0, 1, 2, 3))
        configure_logging(v_level)

    @property
    def compiled_steps(self) -> tuple[CompiledStep, ...]:
        """Read-only views of the cached compiled steps, least recently used first: the last
        one ran last. Its ``forward_graph`` is what ``precision_report`` and ``dump`` show."""
        return tuple(CompiledStep.of(p) for p in self._programs.values())

    def precision_report(self, *, with_autocast: bool = True) -> PrecisionReport:
        """The precision decision for every compute op of the last compiled step."""
        program = self._require_program()
        trace = (
            pipeline.trace_autocast(program) if with_autocast and program.amp is not None else None
        )
        return precision_report(program, trace)

    def dump(self, path: str) -> str:
        """Write per-pass graphs, precision.csv, graph.dot (.svg) and report.html under path."""
        program = self._require_program()
        try:
            report = self.precision_report(with_autocast=program.amp is not None)
        except Exception as e:  # noqa: BLE001 - the oracle is extra information; say why it is missing
            log.warning(
                "%s: autocast comparison skipped in the dump: %s: %s",
                type(self).__name__,
                type(e).__name__,
                e,
            )
            report = self.precision_report(with_autocast=False)
        if program.runner.forensics is None:
            return dump_program(program, report, path)
        return dump_program(program, report, path, self.overflow_report(), self.range_report())

    def _require_program(self) -> Program:
        if not self._programs:
            raise RuntimeError(
                f"{type(self).__name__} has not run yet: call it once "
                "(g(x, y)) so there is a captured graph to inspect"
            )
        return next(reversed(self._programs.values()))

    def __repr__(self) -> str:
        program = next(reversed(self._programs.values())) if self._programs else None
        return graph_repr(self._spec(), repr(self.config), program)


def _unwrapped(graph_name: str, name: str, value: Any) -> Any:
    """The module a wrapper stands for: a torch.compile'd module trains as its original
    (graphamp compiles the whole step itself); FSDP is refused by name."""
    if isinstance(value, nn.Module) and isinstance(getattr(value, "_orig_mod", None), nn.Module):
        log.info(
            "%s.%s is a torch.compile'd module: graphamp captures and compiles its "
            "original module (._orig_mod) as part of the whole step",
            graph_name,
            name,
        )
        return value._orig_mod
    if isinstance(value, nn.Module) and any(
        c.__module__.startswith("torch.distributed.fsdp") for c in type(value).__mro__
    ):
        raise GraphDefinitionError(
            f"{graph_name}.{name} = {type(value).__name__}(...): FSDP-sharded modules "
            "(fully_shard, FullyShardedDataParallel) are not supported by graphamp "
            "(docs/distributed.md). Register the unwrapped module and call "
            "config.enable_zero(stage=1 or 2) for sharded optimizer state, or "
            "config.enable_data_parallel() (a DistributedDataParallel wrapper works too)"
        )
    return value


def _checked_pins(saved: Any) -> list[AmpPin]:
    """The AMP pins of a saved graph state; ConfigError if they do not load."""
    if not isinstance(saved, (list, tuple)):
        raise ConfigError(f"the saved amp_pins must be a list, got {type(saved).__name__}")
    try:
        return [AmpPin.from_dict(d) for d in saved]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"the saved amp_pins do not load: {type(e).__name__}: {e}") from e


def _checked_counters(saved: Any, n_optimizers: int) -> dict[int, int]:
    if not isinstance(saved, dict):
        raise ConfigError(f"optimizer_steps must be a dict, got {type(saved).__name__}")
    out = {}
    for k, v in saved.items():
        index = check_int(
            "an optimizer_steps key",
            int(k) if isinstance(k, str) and k.isdigit() else k,
            at_least=0,
        )
        if index >= n_optimizers:
            raise ConfigError(
                f"the saved state has a step counter for optimizer {index}, but this "
                f"graph has {n_optimizers} optimizer(s): add them before loading"
            )
        out[index] = check_int(f"optimizer {index}'s saved step count", v, at_least=0)
    return out


def _first_param_device(slots: list[OptimizerSlot], k: int) -> torch.device:
    if k < len(slots):
        for group in slots[k].optimizer.param_groups:
            for p in group["params"]:
                return p.device
    return torch.device("cpu")
