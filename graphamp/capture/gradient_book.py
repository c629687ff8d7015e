"""``.grad`` while build() is traced: gradients that build() reads and writes itself.

``loss.backward()`` is recorded, not run (``intercept.py``): most steps never look at a gradient,
and the step differentiates the AMP-rewritten forward later. When build() reads a ``.grad``
(adaptive gradient clipping, SAM's perturbation, gradient noise, an adversarial input's
gradient), the gradients of every loss recorded so far are taken there, inside the trace, the
way eager PyTorch with a ``GradScaler`` does it: each seed is the loss scale, and the results are
unscaled at once (``GradScaler.unscale_``), so build() sees true gradients. Those losses are then
*taken*: the step does not differentiate them again.

Each traced tensor's ``.grad`` lives in this book while build() runs (a fake tensor has none):
reads, writes, in-place changes (``p.grad.mul_``) and ``p.grad = None`` act on it as eager's
``.grad`` would; ``backward()`` after a read adds to it. What the parameters' ``.grad`` hold when
build() returns is the step's *explicit* gradient, to which the gradients of the losses not taken
are added, unscaled; the overflow check runs on the sum, after the user's code. Under data
parallel the gradients build() reads are averaged over the ranks first (every rank's code then
sees the same gradients, as under DDP).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._amp_foreach_non_finite_check_and_unscale_, torch.distributed._functional_collectives
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..errors import CaptureError


@dataclass
class GradientBook:
    """The ``.grad`` of the traced parameters (and of the other leaves build() asks about)."""

    params: Sequence[torch.Tensor]  # the traced parameters, in the forward's order
    loss_scale: torch.Tensor  # the traced 0-dim scale (1 without a scaler)
    # data parallel: the gradients build() reads are averaged over this group first, as DDP's
    # backward() averages them before the user's code sees .grad (None: one process)
    group: Any = None
    grads: dict[int, torch.Tensor | None] = field(default_factory=dict)  # id(leaf) -> .grad
    # id(leaf) -> (the leaf, how many recorded losses its .grad holds)
    leaves: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for p in self.params:
            if p.requires_grad:
                self.leaves[id(p)] = (p, 0)

    @property
    def taken(self) -> int:
        """How many of the recorded losses build() took the gradients of (the first ones)."""
        params = {id(p) for p in self.params}
        counts = [n for key, (_, n) in self.leaves.items() if key in params]
        return min(counts) if counts else 0

    def get(self, tensor: torch.Tensor, losses: list) -> torch.Tensor | None:
        """``tensor.grad``, after the gradients of the losses recorded so far are taken."""
        if id(tensor) not in self.leaves and tensor.requires_grad and tensor.grad_fn is None:
            self.leaves[id(tensor)] = (tensor, 0)  # a leaf build() made (an adversarial input)
        self._take(losses)
        return self.grads.get(id(tensor))

    def set(self, tensor: torch.Tensor, value: torch.Tensor | None, losses: list) -> None:
        """``tensor.grad = value``; what came before it (recorded losses included) is dropped."""
        if value is not None and (value.shape != tensor.shape or value.dtype != tensor.dtype):
            raise CaptureError(
                f"build() assigns a .grad of shape {tuple(value.shape)} and dtype {value.dtype} "
                f"to a tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype}; as in "
                "eager PyTorch, a gradient has its tensor's shape and dtype"
            )
        self._take(losses)
        self.grads[id(tensor)] = value

    def explicit(self) -> list[tuple[int, torch.Tensor]]:
        """(parameter position, .grad) for each trainable parameter whose .grad build() left
        set: the step adds the gradients of the losses not taken to these."""
        out = []
        for i, p in enumerate(self.params):
            g = self.grads.get(id(p))
            if g is not None and p.requires_grad:
                out.append((i, g))
        return out

    def _take(self, losses: list) -> None:
        """Take the gradients of the losses each leaf has not got yet, grouped so that one
        ``autograd.grad`` serves every leaf that missed the same losses."""
        groups: dict[int, list[torch.Tensor]] = {}
        for leaf, n in self.leaves.values():
            if n < len(losses):
                groups.setdefault(n, []).append(leaf)
        for n, leaves in groups.items():
            for restrict, records in _by_restriction(losses[n:]):
                chosen = [t for t in leaves if restrict is None or _is_in(t, restrict)]
                if chosen:
                    self._accumulate(chosen, records)
            for leaf in leaves:
                self.leaves[id(leaf)] = (leaf, len(losses))

    def _accumulate(self, leaves: list[torch.Tensor], records: list) -> None:
        scale = self.loss_scale
        seeds = [
            (torch.ones_like(r.tensor) if r.gradient is None else r.gradient.detach())
            * scale.to(r.tensor.dtype)
            for r in records
        ]
        grads = torch.autograd.grad(
            [r.tensor for r in records], leaves, seeds, retain_graph=True, allow_unused=True
        )
        present = [(t, g) for t, g in zip(leaves, grads) if g is not None]
        # GradScaler.unscale_'s own kernel and reciprocal: what eager's unscale_ gives, bitwise
        unscaled = [g.detach() for _, g in present]
        if unscaled:
            found = torch.zeros((), dtype=torch.float32, device=scale.device)
            inv_scale = scale.double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_(unscaled, found, inv_scale)
        if self.group is not None and unscaled:
            world = dist.get_world_size(self.group)
            summed = funcol.all_reduce_coalesced(unscaled, "sum", self.group)
            unscaled = [g / world for g in summed]
        for (t, _), g in zip(present, unscaled):
            old = self.grads.get(id(t))
            self.grads[id(t)] = g if old is None else old + g


def _by_restriction(records: list) -> list[tuple[Any, list]]:
    """The records grouped by their ``backward(inputs=...)`` (None: every leaf), in order."""
    groups: dict[Any, list] = {}
    for r in records:
        key = tuple(r.inputs) if r.inputs else None
        groups.setdefault(key if key is None else tuple(id(t) for t in key), []).append(r)
    out = []
    for key, members in groups.items():
        out.append((None if key is None else members[0].inputs, members))
    return out


def _is_in(tensor: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
    return any(tensor is t for t in tensors)
