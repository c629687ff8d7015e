"""graphamp.Graph: write the training step once in build(); call it like a function.

The Graph is a facade: it keeps what the user registered (in its ``GraphRuntime``) and the
public entry points. A call enters ``runtime.calls.call`` once: it looks the compiled step up,
has the pipeline build one on a miss, and runs it as a transaction; nothing comes back here.
``docs/architecture.md`` walks one call.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import torch
import torch.nn as nn

from . import pipeline
from .config import GraphConfig
from .errors import ConfigError, GraphDefinitionError
from .forensics.reports import OverflowReport, RangeReport
from .inspect.dump import dump_program
from .inspect.fp8_report import Fp8Report, fp8_report, require_delayed
from .inspect.printing import graph_repr
from .inspect.report import (
    PrecisionReport,
    configure_logging,
    precision_report,
)
from .records.history import TrainingHistory
from .records.optimizers import check_optimizer_slot
from .records.spec import CompiledStep, GraphSpec, OptimizerSlot, Program
from .records.state import SharedState
from .records.update_paths import checked_path
from .records.validate import check_choice
from .runtime import schedulers
from .runtime.calls import GraphRuntime, building_graph, call, graph_spec
from .runtime.graph_state import graph_state_dict, load_graph_state
from .runtime.overflows import overflow_report, range_report
from .runtime.torch_scaler import as_graphamp_scaler
from .scaler import GradScaler
from .sharding.fsdp_adopt import fully_shard_wrap, is_fully_shard_class

log = logging.getLogger("graphamp")
_READY = "_graphamp_ready"


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
        d["_state"] = SharedState(TrainingHistory())
        d["_run"] = GraphRuntime(
            type(self).__name__,
            d["_registered_modules"],
            d["_optimizer_slots"],
            d["config"],
            d["_state"],
            self.build,
            owner=self,
        )
        d["_programs"] = d["_run"].programs  # the compiled steps, least recently used first
        d["_lock"] = threading.RLock()  # one call at a time: a Graph is one training loop
        # graphamp's own attributes: capture does not treat them as settings build() reads
        d["_graphamp_own"] = frozenset(d) | {"_graphamp_own", _READY}
        d["_run"].own_attributes = d["_graphamp_own"]
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
        if isinstance(value, nn.Module):
            # FSDP2's wrap becomes ZeRO-3 in the step: checked and accepted by the settings
            # here, removed from the model at the first call once the settings are final (a
            # refusal, here or there, leaves the model wrapped as it was)
            wrap = fully_shard_wrap(type(self).__name__, name, value)
            if wrap is not None:
                self.__dict__["config"]._adopt_fully_shard(wrap)
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
        added = [s.optimizer for s in self._optimizer_slots]
        max_norm, norm_type = check_optimizer_slot(
            optimizer, lr_sch, clip_grad_max_norm, clip_grad_norm_type, added
        )
        index = len(added)
        eager = pipeline.python_step(optimizer, checked_path(optimizer).traced)
        if eager is not None:
            log.info(
                "%s: optimizer %d (%s) runs its own step() in Python after each compiled step: "
                "%s. The step computes, unscales and clips its gradients; a step that "
                "overflowed skips it (one host read per step, as GradScaler.step)",
                type(self).__name__,
                index,
                type(optimizer).__name__,
                eager,
            )
        hook = getattr(optimizer, "register_load_state_dict_post_hook", None)
        if hook is not None:
            try:
                hook(lambda _: self._optimizer_state_loaded())
            except AttributeError:  # a wrapper that never ran Optimizer.__init__ (Lookahead)
                pass
        # checked and prepared: from here on nothing raises, so a refusal changes nothing
        self._optimizer_slots.append(OptimizerSlot(optimizer, lr_sch, max_norm, norm_type, eager))
        schedulers.silence_order_warning(optimizer)

    def set_grad_scaler(self, scaler: Any) -> None:
        """Scale the loss inside the step: a graphamp.GradScaler / StaticGradScaler, or a
        torch.amp.GradScaler, which graphamp runs inside the step while that object stays the
        truth (its get_scale, state_dict and load_state_dict stay current). A disabled scaler
        (``enabled=False``) or None means no loss scaling, as in torch."""
        self._check_ready()
        self._run.scaler = None if scaler is None else as_graphamp_scaler(scaler)
        self._programs.clear()  # their steps read the previous scaler's state tensors

    @property
    def grad_scaler(self) -> GradScaler | None:
        """The scaler in use (device tensors ``scale`` and ``found_inf``; no sync to read)."""
        return self._run.scaler

    @property
    def history(self) -> TrainingHistory:
        """Per-step rows written on the device: ``g.history.fetch()`` returns them."""
        return self._state.history

    @property
    def step_count(self) -> int:
        """How many times the graph was called (overflow-skipped steps included)."""
        return self._state.step_count

    def build(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must define build(self, ...): the training step, written "
            "once (forward, loss, loss.backward(), return what you want back)"
        )

    # -- running --------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        d = self.__dict__
        if _READY not in d:
            self._check_ready()
        outer = building_graph()
        if outer is not None:
            raise GraphDefinitionError(
                f"{type(self).__name__} was called inside {outer}.build(): a Graph is a whole "
                "training step and cannot be part of another one's capture. Call the modules "
                f"directly in {outer}.build() (register them on {outer}), or call "
                f"{type(self).__name__} outside it"
            )
        with d["_lock"]:
            return call(d["_run"], args, kwargs)

    def _spec(self) -> GraphSpec:
        """What the pipeline may read of this Graph, as of now."""
        return graph_spec(self._run)

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
        return graph_state_dict(self._run)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` saved. Every part is checked before anything changes: a bad
        state raises ConfigError and leaves the graph exactly as it was."""
        load_graph_state(self._run, state)

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
        return overflow_report(self._run)

    def range_report(self) -> RangeReport:
        """The largest magnitude each low-precision value and its gradient reached so far, and
        the headroom left to the dtype's largest number (the last compiled step; one sync)."""
        forensics = self._require_program().runner.forensics
        if forensics is None:
            raise ConfigError(
                f"{type(self).__name__}: ranges are measured with overflow tracing; call "
                "g.config.enable_overflow_tracing() (the next call rebuilds the step with it)"
            )
        return range_report(self._run, forensics)

    def fp8_report(self) -> Fp8Report:
        """Where the delayed fp8 recipe saturated, per operand of each fp8 matmul."""
        require_delayed(type(self).__name__, self.config.fp8_recipe)
        return fp8_report(
            self._require_program(), self._run.state.pass_state, self.config.fp8_margin
        )

    # -- inspection -----------------------------------------------------------------------------
    def debug(self, v_level: int = 1) -> None:
        """0 quiet, 1 capture/compile summary, 2 each pass, 3 each node's precision decision."""
        self._run.debug_level = check_choice("debug level", v_level, (0, 1, 2, 3))
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
        except Exception as e:  # the oracle is extra information; say why it is missing
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
        program = self._programs.last()
        if program is None:
            raise RuntimeError(
                f"{type(self).__name__} has not run yet: call it once "
                "(g(x, y)) so there is a captured graph to inspect"
            )
        return program

    def __repr__(self) -> str:
        program = self._programs.last()
        return graph_repr(self._spec(), repr(self.config), program)


def _unwrapped(graph_name: str, name: str, value: Any) -> Any:
    """The module a wrapper stands for: a torch.compile'd module trains as its original
    (graphamp compiles the whole step itself); FSDP1 is refused by name (FSDP2's fully_shard
    wrap is accepted as it is, and taken over at the first call: sharding/fsdp_adopt.py)."""
    if isinstance(value, nn.Module) and isinstance(getattr(value, "_orig_mod", None), nn.Module):
        log.info(
            "%s.%s is a torch.compile'd module: graphamp captures and compiles its "
            "original module (._orig_mod) as part of the whole step",
            graph_name,
            name,
        )
        return value._orig_mod
    if isinstance(value, nn.Module) and any(
        c.__module__.startswith("torch.distributed.fsdp") and not is_fully_shard_class(c)
        for c in type(value).__mro__
    ):
        raise GraphDefinitionError(
            f"{graph_name}.{name} = {type(value).__name__}(...): FSDP1's "
            "FullyShardedDataParallel is not supported by graphamp (docs/distributed.md). "
            "Wrap with FSDP2's fully_shard instead (graphamp takes its wrap over), or register "
            "the unwrapped module and call config.enable_zero(stage=3)"
        )
    return value
