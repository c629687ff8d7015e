"""Builders shared by the tests: a Graph around a model, and the eager oracles it is checked
against (a plain training step; torch.autocast, with or without a torch.amp.GradScaler)."""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphamp


def make_graph(
    model: nn.Module,
    loss_fn: Callable,
    optimizer=None,
    *,
    backend="aot_eager",
    amp: torch.dtype | None = None,
    scaler=None,
    lr_sch=None,
    clip=None,
    build: Callable | None = None,
    configure: Callable | None = None,
):
    """A Graph training ``model`` with ``loss_fn`` (build: loss(model(x), y); backward; loss)."""

    class TrainGraph(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            if isinstance(loss_fn, nn.Module):
                self.loss_fn = loss_fn
            if optimizer is not None:
                self.add_optimizer(optimizer, lr_sch=lr_sch, clip_grad_max_norm=clip)
            self.config.set_backend(backend)
            if amp is not None:
                self.config.enable_amp(True, dtype=amp)
            if scaler is not None:
                self.set_grad_scaler(scaler)
            if configure is not None:
                configure(self)

        def build(self, x, y):
            if build is not None:
                return build(self, x, y)
            loss = loss_fn(self.model(x), y)
            loss.backward()
            return loss

    return TrainGraph()


def clone_training(model: nn.Module, opt_factory: Callable, sch_factory: Callable | None = None):
    """An independent copy of a model with a fresh optimizer (and scheduler) built the same way."""
    twin = copy.deepcopy(model)
    opt = opt_factory(twin)
    sch = sch_factory(opt) if sch_factory else None
    return twin, opt, sch


def eager_step(model, loss_fn, opt, x, y, sch=None) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    if sch is not None:
        sch.step()
    return loss.detach()


def regression_batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (6x8 input, 6x4 target) batches from seed 1: the optimizer tests' data."""
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(n)]


def eager_steps(model, opt, batches, loss_fn=F.mse_loss, sch=None) -> None:
    """``eager_step`` over every batch."""
    for x, y in batches:
        eager_step(model, loss_fn, opt, x, y, sch)


def sgd_with_state(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.optim.SGD:
    """SGD (lr 0.1, momentum 0.9) over ``model`` after one eager cross-entropy step on ``(x, y)``,
    its gradients cleared: the optimizer has state, so a test's "unchanged" means something."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_step(model, F.cross_entropy, opt, x, y)
    opt.zero_grad(set_to_none=True)
    return opt


# -- the eager AMP oracle: torch.autocast, with or without torch.amp.GradScaler --------------------


def autocast_loss(
    loss_of: Callable[[], torch.Tensor],
    dtype: torch.dtype,
    *,
    backward: bool = True,
    device_type: str = "cpu",
) -> torch.Tensor:
    """Eager torch.autocast's loss (in fp32) for one forward ``loss_of()``; with ``backward``,
    the fp32 loss is differentiated too, leaving the gradients in the parameters' ``.grad``."""
    with torch.autocast(device_type, dtype=dtype):
        loss = loss_of()
    loss = loss.float()
    if backward:
        loss.backward()
    return loss.detach()


@dataclass
class EagerStep:
    """One eager step of ``autocast_step``."""

    loss: torch.Tensor
    scale: float | None  # the loss scale the step used (None without a scaler)
    skipped: bool  # the scaler skipped the step (torch backs off exactly then)
    norm: float | None  # the total gradient norm before clipping (None without clipping)


def autocast_step(
    loss_of: Callable[[], torch.Tensor],
    opt: torch.optim.Optimizer,
    dtype: torch.dtype | None,
    scaler=None,
    *,
    device_type: str = "cpu",
    clip: float | None = None,
    norm_type: float = 2.0,
    after_backward: Callable[[], None] | None = None,
) -> EagerStep:
    """One training step as torch documents it: zero_grad; the forward ``loss_of()`` under
    torch.autocast (``dtype`` None: autocast off); backward of the loss scaled by ``scaler`` (a
    torch.amp.GradScaler, or None); ``after_backward()``; with ``clip``, unscale_ and
    clip_grad_norm_ over the optimizer's parameters; step; update."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device_type, dtype=dtype or torch.float16, enabled=dtype is not None):
        loss = loss_of()
    scale = scaler.get_scale() if scaler is not None else None
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if after_backward is not None:
        after_backward()
    norm = None
    if clip is not None:
        if scaler is not None:
            scaler.unscale_(opt)
        params = [p for group in opt.param_groups for p in group["params"]]
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip, norm_type=norm_type))
    if scaler is None:
        opt.step()
        return EagerStep(loss.detach(), None, False, norm)
    scaler.step(opt)
    scaler.update()
    return EagerStep(loss.detach(), scale, scaler.get_scale() < scale, norm)


def assert_state_close(a: nn.Module, b: nn.Module, rtol=1e-5, atol=1e-6, what="model"):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=rtol, atol=atol, msg=f"{what} {k}")


def assert_optimizer_close(
    a: torch.optim.Optimizer, b: torch.optim.Optimizer, rtol=1e-5, atol=1e-6
):
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys(), (sorted(sa), sorted(sb))
    for i in sa:
        assert sa[i].keys() == sb[i].keys(), (i, sorted(sa[i]), sorted(sb[i]))
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                x, y = x.cpu().to(y.dtype) if k == "step" else x, y
                torch.testing.assert_close(
                    x.reshape(y.shape), y, rtol=rtol, atol=atol, msg=f"optimizer state {i}.{k}"
                )
            else:
                assert float(x) == float(y), (i, k, x, y)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    state = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    if opt is not None:
        state["opt"] = copy.deepcopy(opt.state_dict())
    return state


def assert_unchanged(before: dict, model: nn.Module, opt=None) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(before["model"][k], v), f"{k} changed"
    if opt is not None:
        after = opt.state_dict()
        assert after["state"].keys() == before["opt"]["state"].keys(), "optimizer state changed"
        for i, s in after["state"].items():
            for k, v in s.items():
                assert torch.equal(
                    torch.as_tensor(before["opt"]["state"][i][k]), torch.as_tensor(v)
                ), f"optimizer state {i}.{k} changed"


def assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    """Every tensor of ``a`` equals its peer in ``b`` bitwise: nested lists, tuples and dicts of
    the same shape (same lengths, same keys); other leaves compare with ==."""
    if isinstance(a, torch.Tensor):
        shown = f": {a} != {b}" if a.numel() <= 8 else ""
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where}{shown}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for key in a:
            assert_bitwise(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


class Twin:
    """A graph over ``model`` and an eager twin, stepped on the same batches: each step's
    loss, and at ``check()`` the parameters and the optimizer state, must agree with eager
    fp32 (or with ``torch.autocast`` + the eager step when ``amp`` is given)."""

    def __init__(self, model, make_opt, amp=None, make_sch=None, **kwargs):
        self.ref = copy.deepcopy(model)
        self.model = model
        self.opt, self.ref_opt = make_opt(model), make_opt(self.ref)
        self.sch = make_sch(self.opt) if make_sch else None
        self.ref_sch = make_sch(self.ref_opt) if make_sch else None
        self.g = make_graph(
            model, nn.CrossEntropyLoss(), self.opt, amp=amp, lr_sch=self.sch, **kwargs
        )
        self.amp = amp

    def step(self, x, y, rtol=1e-5, atol=1e-6, graph_context=contextlib.nullcontext):
        with graph_context():
            loss = self.g(x, y)
        if self.amp is None:
            ref = eager_step(self.ref, F.cross_entropy, self.ref_opt, x, y, self.ref_sch)
        else:
            ref = autocast_step(lambda: F.cross_entropy(self.ref(x), y), self.ref_opt, self.amp)
            ref = ref.loss
        torch.testing.assert_close(loss, ref.float().detach(), rtol=rtol, atol=atol)
        return loss

    def check(self, rtol=1e-5, atol=1e-6):
        assert_state_close(self.model, self.ref, rtol=rtol, atol=atol)
        assert_optimizer_close(self.opt, self.ref_opt, rtol=rtol, atol=atol)


def import_torch_testing(name: str) -> Any:
    """A module of torch's own test suite, ``torch.testing._internal.<name>``. Importing its
    ``common_utils`` freezes ``torch.backends``' flags for the whole process
    (``disable_global_flags``), so a later test that sets ``torch.backends.cudnn.benchmark``
    would fail: they are unfrozen again here."""
    flags = torch.backends.flags_frozen.__globals__  # torch.backends' own module globals
    allowed = flags["__allow_nonbracketed_mutation_flag"]
    try:
        return importlib.import_module(f"torch.testing._internal.{name}")
    finally:
        flags["__allow_nonbracketed_mutation_flag"] = allowed


# -- several processes ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    script: str, *args: str, nproc: int = 2, timeout: float = 240, env: dict | None = None
) -> str:
    """``script args`` under torchrun on ``nproc`` CPU processes (one thread each, ``env``
    added to the environment); its stderr. A failed run fails the test with the end of stderr."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        script,
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr
