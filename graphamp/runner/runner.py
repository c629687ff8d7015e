"""Running a compiled step: gather the live state, refresh what changed, call the program.

The user's parameters, buffers and optimizer state stay the truth: each call looks them up
again through the dicts that hold them (so reassignment and ``.to()`` are followed), refreshes
the hyperparameter tensors whose values changed (a device copy, no recompile), and passes
everything to the compiled step in the order of the plan's StepLayout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.autograd.graph import increment_version

from ..errors import CaptureError
from ..forensics.device_record import ForensicsState
from ..records.optimizers import OptimizerPlan
from ..records.replays import apply_replays
from ..records.spec import StepFn, StepPlan
from ..records.state import SharedState
from . import momentum
from .closure import LossClosure
from .cudagraph import CudaGraphsBySize, CudaGraphStep

log = logging.getLogger("graphamp")
Slot = tuple[dict, str]  # (the dict holding a tensor, its key): a live lookup
_MISSING = object()


@dataclass
class HyperSlot:
    """One param group's hyperparameters as device tensors, refreshed when the group changes.

    The group is looked up by index at every call: ``optimizer.load_state_dict`` replaces the
    group dicts. A tensor hyperparameter (a tensor lr, as compiled optimizers recommend) is
    copied when it is another tensor or was changed in place (its version counter moved)."""

    plan: OptimizerPlan
    index: int  # the param group's position in plan.optimizer.param_groups
    tensors: list[torch.Tensor]
    seen: tuple = ()

    def sync(self) -> None:
        values = self.plan.hyper_values(self.plan.optimizer.param_groups[self.index])
        seen = tuple((id(v), v._version) if isinstance(v, torch.Tensor) else v for v in values)
        if seen == self.seen:
            return
        for t, v in zip(self.tensors, values):
            if isinstance(v, torch.Tensor):
                t.copy_(v.reshape(()))  # a device copy, no sync
            else:
                t.fill_(v)  # a kernel argument, no sync
        self.seen = seen


class Runner:
    """The runtime side of one Program (spec.StepRunner), made once its step is compiled.

    ``cuda_graph_batch``: replay the compiled step as a CUDA graph, captured on this batch (a
    capture that fails is logged and the step runs without it); ``cuda_graph_sizes``: the step
    is dynamic, replayed as one graph per batch shape, at most that many kept (0: none)."""

    def __init__(
        self,
        plan: StepPlan,
        root: nn.Module,
        state: SharedState,
        device: torch.device,
        compiled: StepFn,
        *,
        cuda_graph_batch: list[torch.Tensor] | None = None,
        cuda_graph_sizes: int | None = None,
        graph_name: str = "",
        component_inputs: dict[str, list[torch.Tensor]],
    ):
        cap = plan.captured
        self.plan = plan
        self.param_slots = _slots(root, cap.param_names, "_parameters")
        self.buffer_slots = _slots(root, cap.buffer_names, "_buffers")
        self.hyper = _hyper_slots(plan, device)
        self.fed: list[float] = []  # this call's lifted floats (``gather``)
        self.shared = state
        self.counters = [
            state.counter(opt.index, device, opt.has_state()) for opt in plan.optimizers
        ]
        # the forward's state from the AMP passes, shared by the graph's steps
        self.pass_state = state.pass_state_tensors(plan.pass_state, device)
        # the step components' input groups (the scaler's state, the history, this rank's number,
        # the overflow record): their live tensors, made by the components
        # (``step/components/``), fed to every call as they are
        self.component_inputs = component_inputs
        plan.placement.track(plan.optimizers)
        # overflow tracing: this step's own record (its probes are its own)
        self.forensics = (
            ForensicsState(plan.probes, self.component_inputs["forensics"])
            if plan.probes is not None
            else None
        )
        self.opt_state: list[torch.Tensor] | None = None
        self._to_install: list[tuple] = []  # optimizer state made at gather, installed at commit
        self.momentum_fresh: list[torch.Tensor] = []  # momentum.py: the step's flags
        self._flag_writes: list[momentum.FlagWrite] = []  # made at gather, applied at commit
        # (optimizer.state, parameter, key, tensor) for every state tensor in use: a user's
        # edit of optimizer.state (clear, a replaced tensor, a deleted entry) is seen at the
        # next call by identity, without reading any tensor
        self._state_refs: list[tuple] = []
        self._state_dicts: list[tuple] = []  # (optimizer, its state dict): a replaced .state
        self.calls = 0
        self._warned_aliasing = False
        # the parameters each call updates in place (fixed per plan): version counters to bump
        self.updated_params = [p for opt in plan.optimizers for p in opt.params]
        self.compiled = compiled
        self.uses_cuda_graph = False
        if cuda_graph_batch is not None and cuda_graph_sizes != 0:
            self._replay_as_cuda_graph(cuda_graph_batch, graph_name, cuda_graph_sizes)

    def _replay_as_cuda_graph(
        self, batch: list[torch.Tensor], graph_name: str, sizes: int | None
    ) -> None:
        n_state = self.plan.layout.n_state
        try:
            if sizes is None:  # a static step: one graph
                self.compiled = CudaGraphStep(self.compiled, n_state, self.gather(batch))
            else:  # a dynamic step: one graph per batch shape, lazily
                self.compiled = CudaGraphsBySize(self.compiled, n_state, self.gather(batch), sizes)
            self.uses_cuda_graph = True
        except Exception as e:  # fall back, and say why
            log.warning(
                "%s: CUDA graph capture failed, running without it: %s: %s",
                graph_name,
                type(e).__name__,
                e,
            )

    def gather(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The step's flat inputs for this call, with every refresh applied. Changes nothing
        the user can see: optimizer state graphamp creates is installed by ``record_step``."""
        opt_state = self.opt_state
        if opt_state is None or (not self._to_install and self._optimizer_state_edited()):
            opt_state = self._materialize()
        for slot in self.hyper:
            slot.sync()
        # the Python floats the step takes as inputs, read now: a scheduler that steps before
        # the compiled step has set the next step's lr in the param groups by then
        with torch.no_grad():
            self.fed = [value.feed() for value in self.plan.captured.lifted]
        if not self.uses_cuda_graph:  # a CUDA graph copies the batch into buffers of its own
            inputs = self._unaliased(inputs)
        return self.plan.layout.flatten(self._groups(opt_state, inputs))

    def _unaliased(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The batch, with a copy of each tensor that shares memory with a parameter or buffer
        (``g(model.weight[:4])``): the step writes the state in place, and the value the batch
        had when the call was made is the one build() reads, as in eager."""
        # looked up at every call, not cached: `p.data = other` keeps the parameter and moves
        # its memory (measured: 0.6 us for 4 state tensors, 9 us for 76)
        state = [*self._params(), *(d[k] for d, k in self.buffer_slots)]
        storages = {t.untyped_storage().data_ptr() for t in state} - {0}
        if not any(t.untyped_storage().data_ptr() in storages for t in inputs):
            return inputs
        if not self._warned_aliasing:
            self._warned_aliasing = True
            log.info(
                "a tensor passed to the step shares memory with a parameter or buffer: it is "
                "copied before each such call (the step updates the state in place)"
            )
        return [t.clone() if t.untyped_storage().data_ptr() in storages else t for t in inputs]

    def _params(self) -> list[torch.Tensor]:
        """The parameters as the step takes them (``plan.placement``: the user's, or the rows
        their shards view)."""
        parameter = self.plan.placement.parameter
        return [parameter(d[k]) for d, k in self.param_slots]

    def _optimizer_state_edited(self) -> bool:
        for optimizer, state in self._state_dicts:
            if optimizer.state is not state:
                return True
        for state, p, key, t in self._state_refs:
            per_param = state.get(p)
            if per_param is None or per_param.get(key) is not t:
                return True
        return False

    def _materialize(self) -> list[torch.Tensor]:
        """Look the optimizer state up again (first call, a load, or the user's edit)."""
        flat, install = materialize_optimizer_state(self.plan)
        slots = _all_state_slots(self.plan)
        self.momentum_fresh, self._flag_writes = momentum.momentum_flags(
            self.plan, self.shared, slots, flat
        )
        self.opt_state, self._to_install = flat, install
        self._state_dicts = [(o.optimizer, o.optimizer.state) for o in self.plan.optimizers]
        self._state_refs = [(o.optimizer.state, p, key, t) for (o, (p, key)), t in zip(slots, flat)]
        return flat

    def _groups(
        self, opt_state: list[torch.Tensor], inputs: list[torch.Tensor]
    ) -> dict[str, list[torch.Tensor]]:
        return {
            "params": self._params(),
            "buffers": [d[k] for d, k in self.buffer_slots],
            "opt_state": opt_state,
            "hyper": [t for slot in self.hyper for t in slot.tensors],
            "counters": self.counters,
            "momentum_fresh": self.momentum_fresh,
            "pass_state": self.pass_state,
            **self.component_inputs,
            "constants": self.plan.captured.constants,
            "inputs": inputs,
        }

    def execute(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run the compiled step on ``gather``'s inputs (it writes the state in place); then
        put the tensors build() writes on the user's objects where it writes them."""
        cap = self.plan.captured
        with torch.no_grad():
            outputs = list(self.compiled(*flat))
        if cap.replays:
            end = cap.num_user_outputs
            apply_replays(cap.replays, outputs[end - cap.num_written : end])
        return outputs

    def step_eagerly(
        self, outputs: list[torch.Tensor], again: Callable[[], list[torch.Tensor]]
    ) -> None:
        """The optimizers whose own step() runs after the compiled one (``records.update_paths.PYTHON_STEP``), on the
        step's outputs that follow build()'s: each parameter's ``.grad`` is the gradient the
        step computed (unscaled, clipped, after build()'s gradient code), step() runs as eager
        runs it, and ``.grad`` is cleared again, as the compiled updates leave it. A step that
        overflowed skips them: one host read, as ``GradScaler.step``'s. An optimizer whose
        step() takes a closure gets one that runs the step again (``again``: ``closure.py``)."""
        n = self.plan.eager_outputs
        if not n:
            return
        tail = list(outputs[len(outputs) - n :])
        if self.plan.scaler is not None and bool(tail.pop()):
            return
        grads = iter(tail)
        for opt in self.plan.optimizers:
            if not opt.path.in_python:
                continue
            for p in opt.params:
                p.grad = next(grads)
            try:
                if opt.path.given_closure:  # the plan's only optimizer, no scaler
                    # torch types a closure as returning float; LBFGS's returns the loss tensor
                    closure = LossClosure(outputs, opt.params, again)
                    opt.optimizer.step(closure)  # type: ignore[arg-type]
                else:
                    opt.optimizer.step()
            finally:
                for p in opt.params:
                    p.grad = None

    def run_again(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The compiled step run again on the call's batch, for an optimizer's closure
        (``closure.py``). What counts calls on the device (the optimizers' applied steps, the
        history's step and its row) is put back after it: a call counts once, whatever number
        of times its loss is evaluated, and its history row keeps its first loss, the one
        the call returns."""
        kept = [t.clone() for t in self.counters]
        with self.shared.history.last_step_kept():
            outputs = self.execute(self.gather(inputs))
        for t, before in zip(self.counters, kept):
            t.copy_(before)
        return outputs

    def record_step(self) -> Callable[[], None]:
        """The bookkeeping of a step, done before it runs so that the step itself is the last
        thing that happens: installs the optimizer state gather created, counts the call, bumps
        the updated parameters' version counters (as eager optimizer steps do, so autograd sees
        the change). Returns the function that undoes it if the step then fails."""
        installed = []
        for optimizer, p, key, t in self._to_install:
            previous = optimizer.state.get(p, {}).get(key, _MISSING)
            optimizer.state[p][key] = t
            installed.append((optimizer, p, key, previous))
        pending, self._to_install = self._to_install, []
        writes, self._flag_writes = self._flag_writes, []
        undo_flags = momentum.commit(writes)
        self.calls += 1
        if self.plan.training:
            _increment_versions(self.updated_params)

        def undo() -> None:
            for optimizer, p, key, previous in reversed(installed):
                if previous is _MISSING:
                    del optimizer.state[p][key]
                    if not optimizer.state[p]:
                        del optimizer.state[p]
                else:
                    optimizer.state[p][key] = previous
            self._to_install = pending
            undo_flags()
            self._flag_writes = writes
            self.calls -= 1

        return undo

    def invalidate_optimizer_state(self) -> None:
        """The user loaded an optimizer state dict: gather its tensors again at the next call
        (a CUDA graph notices the new addresses and is captured again)."""
        self.opt_state = None


def _hyper_slots(plan: StepPlan, device: torch.device) -> list[HyperSlot]:
    """One slot per param group of every optimizer, synced with the group's values."""
    slots = [
        HyperSlot(
            opt,
            k,
            opt.hyper_inputs(k, device),
        )
        for opt in plan.optimizers
        for k in range(len(opt.optimizer.param_groups))
    ]
    for slot in slots:
        slot.sync()
    return slots


def _slots(root: nn.Module, names: list[str], kind: str) -> list[Slot]:
    """(the dict holding a tensor, its key): a live lookup that follows reassignment and .to()."""
    slots = []
    for name in names:
        prefix, _, attr = name.rpartition(".")
        module = root.get_submodule(prefix) if prefix else root
        slots.append((getattr(module, kind), attr))
    return slots


def _all_state_slots(plan: StepPlan) -> list[tuple]:
    """(optimizer plan, (parameter, key)) in the layout order of the state tensors."""
    return [(opt, slot) for opt in plan.optimizers for slot in opt.state_slots()]


def _increment_versions(tensors: list[torch.Tensor]) -> None:
    try:
        increment_version(tensors)
    except TypeError:  # torch versions whose increment_version takes one tensor
        for t in tensors:
            increment_version(t)


def materialize_optimizer_state(plan: StepPlan):
    """(the optimizer state tensors in layout order, [(optimizer, parameter, key, tensor)] still
    to be installed): created in torch's format where missing; nothing is written into the
    optimizer here (``Runner.record_step`` installs them when the step is committed).

    Existing state (from a checkpoint or earlier eager steps) is kept; a ``step`` on the CPU is
    copied to the parameters' device, where the compiled step can update it without a sync.
    """
    flat, install = [], []
    for opt in plan.optimizers:
        for p, key in opt.state_slots():
            existing = opt.optimizer.state.get(p, {}).get(key)
            t = existing
            if plan.placement.state_is_row(key):
                t = _state_row(plan, opt, key, p, existing)
            elif t is None:
                t = opt.initial_state(p, key)
            elif opt.path.traced:
                t = _traced_state(opt, key, p, t)
            elif key == "step":
                t = torch.as_tensor(t).to(device=p.device, dtype=torch.float32)
            elif t.shape != p.shape or t.device != p.device:
                raise CaptureError(
                    f"optimizer {opt.index} state {key!r} has shape {tuple(t.shape)} on "
                    f"{t.device}, its parameter {tuple(p.shape)} on {p.device}: the loaded "
                    "optimizer state does not belong to these parameters"
                )
            if t is not existing:
                install.append((opt.optimizer, p, key, t))
            flat.append(t)
    return flat, install


def _traced_state(opt: OptimizerPlan, key: str, p: torch.Tensor, t: Any) -> torch.Tensor:
    """An existing state tensor of a traced optimizer, on the parameter's device, checked
    against what the optimizer's first step makes."""
    first = opt.first_state(p, key)
    t = torch.as_tensor(t)
    if t.shape != first.shape or t.dtype != first.dtype:
        raise CaptureError(
            f"optimizer {opt.index} state {key!r} is {tuple(t.shape)} {t.dtype}, where "
            f"{type(opt.optimizer).__name__}'s first step makes {tuple(first.shape)} "
            f"{first.dtype}: the loaded optimizer state does not belong to these parameters"
        )
    return t.to(device=p.device)


def _state_row(plan: StepPlan, opt: OptimizerPlan, key: str, p: torch.Tensor, existing):
    try:
        return plan.placement.state_row(opt, key, p, existing)
    except ValueError as e:
        raise CaptureError(
            f"optimizer {opt.index}: {e}: the loaded optimizer state does not "
            "belong to these parameters"
        ) from None
