"""The world around a call. Ambient torch modes, Python side effects in forward,
wrapped and copied objects, schedulers and optimizer-state edits: each is honoured as eager
PyTorch would (the oracle) or refused by a graphamp error that changes nothing."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import re

import helpers
import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim.lr_scheduler as lrs
from helpers import (
    assert_optimizer_close,
    assert_state_close,
    assert_unchanged,
    eager_step,
    make_graph,
    snapshot,
)

import graphamp
from graphamp import CaptureError, ConfigError
from graphamp.errors import GraphDefinitionError


def _mlp() -> nn.Module:
    return models.mlp(16, 12, 4, seed=0)


def _batches(n=4):
    return models.batches(n, 8, 16, 4, seed=1)


def Twin(model=None, make_opt=None, **kwargs) -> helpers.Twin:
    """``helpers.Twin`` over this module's MLP and SGD with momentum unless given others."""
    model = model if model is not None else _mlp()
    make_opt = make_opt or (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    return helpers.Twin(model, make_opt, **kwargs)


# -- 1. ambient modes --------------------------------------------------------------------------

AMBIENT = {
    "autocast cpu bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "autocast cpu fp16": lambda: torch.autocast("cpu", dtype=torch.float16),
    "autocast disabled": lambda: torch.autocast("cpu", enabled=False),
    "no_grad": torch.no_grad,
    "enable_grad": torch.enable_grad,
    "set_grad_enabled(False)": lambda: torch.set_grad_enabled(False),
    "inference_mode": torch.inference_mode,
    "anomaly detection": torch.autograd.detect_anomaly,
}


@contextlib.contextmanager
def _default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def _deterministic():
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)


AMBIENT["default dtype float64"] = lambda: _default_dtype(torch.float64)
AMBIENT["deterministic algorithms"] = _deterministic


FAST_MODES = {("autocast cpu bf16", True), ("inference_mode", True), ("no_grad", False)}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "mode, first_inside",
    [
        pytest.param(m, f, marks=() if (m, f) in FAST_MODES else pytest.mark.slow)
        for m in sorted(AMBIENT)
        for f in (True, False)
    ],
)
def test_an_ambient_mode_gives_the_same_steps_as_plain_eager(mode, first_inside):
    """The first call inside the mode and later calls outside (or the reverse): every step
    equals a plain fp32 eager step, the ambient mode neither leaking in nor baking in."""
    t = Twin()
    inside, outside = AMBIENT[mode], contextlib.nullcontext
    order = (
        [inside, outside, inside, outside] if first_inside else [outside, inside, outside, inside]
    )
    for (x, y), ctx in zip(_batches(), order):
        loss = t.step(x, y, graph_context=ctx)
        assert loss.dtype == torch.float32 and not loss.requires_grad
    t.check()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_ambient_autocast_does_not_change_graphamps_own_amp():
    """With AMP on, a call made inside a user's autocast block runs graphamp's precision plan:
    bitwise the steps of the same graph called outside it."""
    a, b = _mlp(), _mlp()
    graphs = [
        make_graph(
            m, nn.CrossEntropyLoss(), torch.optim.SGD(m.parameters(), lr=0.1), amp=torch.bfloat16
        )
        for m in (a, b)
    ]
    for x, y in _batches(3):
        with torch.autocast("cpu", dtype=torch.float16):
            inside = graphs[0](x, y)
        outside = graphs[1](x, y)
        assert torch.equal(inside, outside)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.slow
def test_the_default_dtype_of_a_call_is_honoured_by_capturing_again():
    """Factories in build() follow the default dtype, as in eager: a call under another default
    dtype captures again rather than reusing a program baked with the first one."""
    model = _mlp()

    def build(g, x, y):
        loss = F.cross_entropy(g.model(x), y)
        loss.backward()
        return loss + torch.zeros(())  # a factory: float64 under a float64 default

    g = make_graph(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), build=build)
    ((x, y),) = _batches(1)
    assert g(x, y).dtype == torch.float32
    with _default_dtype(torch.float64):
        assert g(x, y).dtype == torch.float64
    assert g(x, y).dtype == torch.float32
    assert len(g.compiled_steps) == 2


# -- 2. side effects in forward ----------------------------------------------------------------


def _register(kind, model, seen):
    def record(*args):
        seen.append(args)

    if kind == "forward hook":
        return model[0].register_forward_hook(record)
    if kind == "forward pre-hook":
        return model[0].register_forward_pre_hook(record)
    if kind == "backward hook":
        return model[2].register_full_backward_hook(record)
    if kind == "global forward hook":
        return nn.modules.module.register_module_forward_hook(record)
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind, when",
    [
        pytest.param(
            k,
            w,
            marks=()
            if (k, w) in {("forward hook", "after a call"), ("global forward hook", "first call")}
            else pytest.mark.slow,
        )
        for k in ("forward hook", "forward pre-hook", "backward hook", "global forward hook")
        for w in ("first call", "after a call")
    ],
)
def test_a_hook_is_refused_by_name_and_nothing_changes(kind, when):
    t = Twin()
    data = _batches(2)
    if when == "after a call":
        t.step(*data[0])
    seen = []
    handle = _register(kind, t.model, seen)
    try:
        before = snapshot(t.model, t.opt)
        steps = t.g.step_count
        with pytest.raises(CaptureError, match=f"{kind}.*record.*test_context.py"):
            t.g(*data[1])
        assert_unchanged(before, t.model, t.opt)
        assert t.g.step_count == steps and seen == []  # never ran, so never held fake tensors
    finally:
        handle.remove()
    t.step(*data[1])  # without the hook, the graph goes on as eager
    t.check()


def _pruned(module):
    torch.nn.utils.prune.l1_unstructured(module, "weight", amount=0.5)
    torch.nn.utils.prune.random_unstructured(module, "weight", amount=0.2)  # a container


@pytest.mark.parametrize("legacy", ["weight_norm", "spectral_norm", "prune"])
def test_torchs_weight_computing_hooks_train_as_eager(legacy):
    # torch.nn.utils.weight_norm, spectral_norm and the pruning methods install forward
    # pre-hooks (refused before): traced, the weight is computed in the step and replayed onto
    # the module, as eager sets it
    make = _pruned if legacy == "prune" else getattr(torch.nn.utils, legacy)
    model, twin = _mlp(), _mlp()
    for m in (model, twin):  # spectral_norm and random pruning draw
        torch.manual_seed(1)
        make(m[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    for x, y in _batches(3):
        loss = g(x, y)
        eager_opt.zero_grad()
        eager = nn.functional.cross_entropy(twin(x), y)
        eager.backward()
        eager_opt.step()
        torch.testing.assert_close(loss, eager.detach())
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)  # weight_g/_orig/_mask, spectral_norm's u, v
    torch.testing.assert_close(model[0].weight, twin[0].weight)  # the hook's attribute
    assert len(g.compiled_steps) == 1


class LazyCache(nn.Module):
    """Builds a cache on its first forward: a common idiom."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        if not hasattr(self, "scale"):
            self.scale = x.abs().mean()
        return self.lin(x)


class CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize(
    "model_type, attribute, line",
    [
        (LazyCache, "self.model.scale", "self.scale = x.abs().mean()"),
        (CountsCalls, "self.model.calls", "self.calls += 1"),
    ],
)
def test_an_attribute_written_in_forward_is_refused_and_put_back(model_type, attribute, line):
    model = model_type()
    before_vars = dict(vars(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    before = snapshot(model, opt)
    x, y = _batches(1)[0]
    with pytest.raises(
        CaptureError, match=rf"{attribute} at .*test_context.py:\d+.*" + re.escape(line)
    ):
        g(x, y)
    assert vars(model) == before_vars  # no FakeTensor left in the user's module
    assert_unchanged(before, model, opt)
    assert not model(x).isnan().any()  # eager use afterwards works


def test_a_tensor_written_on_the_graph_in_build_holds_each_calls_value_as_in_eager():
    """build() keeps the loss on the Graph: written on every call from that call's values, so
    the compiled step outputs it and graphamp puts it there after every call (no FakeTensor,
    no stale value)."""
    model = _mlp()

    def build(g, x, y):
        loss = F.cross_entropy(g.model(x), y)
        loss.backward()
        g.last_loss = loss
        return loss

    g = make_graph(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), build=build)
    for x, y in _batches(2):
        loss = g(x, y)
        assert type(g.last_loss) is torch.Tensor
        assert torch.equal(g.last_loss, loss)
    assert len(g.compiled_steps) == 1


@pytest.mark.slow
def test_torchs_own_forward_caches_are_put_back_silently():
    """nn.LSTM refreshes its private _flat_weights list in forward; after capture it holds the
    real parameters again and the model trains as eager."""
    torch.manual_seed(0)

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(16, 8, batch_first=True)
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    model = Tagger()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        x, y = torch.randn(4, 5, 16, generator=gen), torch.randint(0, 4, (4,), generator=gen)
        torch.testing.assert_close(g(x, y), eager_step(ref, F.cross_entropy, ref_opt, x, y))
    assert all(not isinstance(w, torch._subclasses.FakeTensor) for w in model.rnn._flat_weights)
    assert_state_close(model, ref)


# -- 3. wrapped and copied objects -------------------------------------------------------------


def test_a_torch_compiled_module_trains_as_its_original():
    plain = _mlp()
    t = Twin(torch.compile(plain, backend="eager"))
    assert t.g.model is plain  # the original module is registered
    for x, y in _batches(3):
        t.step(x, y)
    assert_state_close(plain, t.ref._orig_mod)
    assert_optimizer_close(t.opt, t.ref_opt)


def test_a_torch_compiled_submodule_is_refused_by_name():
    model = _mlp()
    model[2] = torch.compile(model[2], backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    before = snapshot(model, opt)
    with pytest.raises(CaptureError, match=r"'model.2' is a torch.compile'd module.*_orig_mod"):
        g(*_batches(1)[0])
    assert_unchanged(before, model, opt)


@pytest.mark.slow
def test_a_parametrized_module_trains_as_eager():
    model = _mlp()
    torch.nn.utils.parametrizations.weight_norm(model[0])
    t = Twin(model)
    for x, y in _batches(3):
        t.step(x, y)
    t.check()


def test_an_fsdp1_module_is_refused_by_name():
    """FSDP1's FullyShardedDataParallel is refused at registration, nothing registered (FSDP2's
    fully_shard is taken over instead: tests/test_zero.py, on processes)."""
    model = _mlp()
    g = make_graph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    sharded = nn.Linear(16, 4)
    # a class of FSDP1's module (the wrapper itself needs a process group to be made)
    module = "torch.distributed.fsdp.fully_sharded_data_parallel"
    sharded.__class__ = type("FSDP1Linear", (nn.Linear,), {"__module__": module})
    with pytest.raises(GraphDefinitionError, match="FSDP1Linear.*FSDP1.*fully_shard"):
        g.other = sharded
    assert "other" not in vars(g) and list(g._registered_modules) == ["model", "loss_fn"]


def test_copying_or_saving_a_graph_is_refused_with_the_way_to_do_it():
    t = Twin()
    data = _batches(2)
    t.step(*data[0])
    ways = {
        "deepcopy": copy.deepcopy,
        "copy": copy.copy,
        "pickle": pickle.dumps,
        "torch.save": lambda g: torch.save(g, io.BytesIO()),
    }
    for _how, copy_it in ways.items():
        with pytest.raises(GraphDefinitionError, match=r"state_dict\(\)"):
            copy_it(t.g)
    t.step(*data[1])  # still works
    t.check()


def test_a_graph_called_inside_another_graphs_build_is_refused_by_name():
    inner_model, outer_model = _mlp(), _mlp()
    inner = make_graph(
        inner_model, nn.CrossEntropyLoss(), torch.optim.SGD(inner_model.parameters(), lr=0.1)
    )
    ((x, y),) = _batches(1)
    inner(x, y)  # compiled already: the nested call must still be refused

    def build(g, x, y):
        loss = F.cross_entropy(g.model(x), y) + inner(x, y)
        loss.backward()
        return loss

    opt = torch.optim.SGD(outer_model.parameters(), lr=0.1)
    outer = make_graph(outer_model, F.cross_entropy, opt, build=build)
    before_inner, before_outer = snapshot(inner_model), snapshot(outer_model, opt)
    with pytest.raises(GraphDefinitionError, match="TrainGraph was called inside TrainGraph.build"):
        outer(x, y)
    assert_unchanged(before_inner, inner_model)
    assert_unchanged(before_outer, outer_model, opt)
    assert inner.step_count == 1
    inner(x, y)  # both still usable
    assert inner.step_count == 2


# -- 4. schedulers -----------------------------------------------------------------------------

SCHEDULERS = {
    "LambdaLR": lambda o: lrs.LambdaLR(o, lambda s: 1 / (s + 1)),
    "MultiplicativeLR": lambda o: lrs.MultiplicativeLR(o, lambda s: 0.9),
    "StepLR": lambda o: lrs.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: lrs.MultiStepLR(o, milestones=[1, 3], gamma=0.3),
    "ConstantLR": lambda o: lrs.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: lrs.LinearLR(o, start_factor=0.2, total_iters=3),
    "ExponentialLR": lambda o: lrs.ExponentialLR(o, gamma=0.8),
    "PolynomialLR": lambda o: lrs.PolynomialLR(o, total_iters=4, power=2.0),
    "CosineAnnealingLR": lambda o: lrs.CosineAnnealingLR(o, T_max=3),
    "CosineAnnealingWarmRestarts": lambda o: lrs.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2),
    "CyclicLR": lambda o: lrs.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),
    "OneCycleLR": lambda o: lrs.OneCycleLR(o, max_lr=0.2, total_steps=6),
    "SequentialLR": lambda o: lrs.SequentialLR(
        o,
        [lrs.LinearLR(o, start_factor=0.5, total_iters=2), lrs.ExponentialLR(o, gamma=0.7)],
        milestones=[2],
    ),
    "ChainedScheduler": lambda o: lrs.ChainedScheduler(
        [lrs.ExponentialLR(o, gamma=0.9), lrs.StepLR(o, step_size=2, gamma=0.5)]
    ),
}


def test_every_scheduler_in_torch_is_covered():
    classes = {
        n
        for n, c in vars(lrs).items()
        if isinstance(c, type)
        and not n.startswith("_")
        and issubclass(c, (lrs.LRScheduler, lrs.ReduceLROnPlateau))
        and c.__module__ == lrs.__name__
    } - {"LRScheduler", "ReduceLROnPlateau"}
    assert classes <= set(SCHEDULERS), sorted(classes - set(SCHEDULERS))


class Heads(nn.Module):
    """One head per scheduler: each head gets its own optimizer and scheduler."""

    def __init__(self, n: int):
        super().__init__()
        torch.manual_seed(0)
        self.heads = nn.ModuleList(nn.Linear(16, 4) for _ in range(n))

    def forward(self, x):
        return sum(h(x) for h in self.heads)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_scheduler_is_honoured_step_for_step_in_one_graph():
    """All of torch's schedulers at once, one optimizer each, in one compiled step (one
    compile keeps the test fast): every lr, momentum and parameter as in the eager loop."""
    names = sorted(SCHEDULERS)
    model = Heads(len(names))
    ref = copy.deepcopy(model)
    opts, ref_opts = (
        [torch.optim.SGD(h.parameters(), lr=0.1, momentum=0.9) for h in m.heads]
        for m in (model, ref)
    )
    schs = [SCHEDULERS[n](o) for n, o in zip(names, opts)]
    ref_schs = [SCHEDULERS[n](o) for n, o in zip(names, ref_opts)]

    def add_all(g):
        for opt, sch in zip(opts, schs):
            g.add_optimizer(opt, lr_sch=sch)

    g = make_graph(model, nn.CrossEntropyLoss(), configure=add_all)
    for x, y in _batches(5):
        loss = g(x, y)
        for o in ref_opts:
            o.zero_grad(set_to_none=True)
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        for o, sch in zip(ref_opts, ref_schs):
            o.step()
            sch.step()
        torch.testing.assert_close(loss, ref_loss.detach())
        for name, o, r in zip(names, opts, ref_opts):
            assert (o.param_groups[0]["lr"], o.param_groups[0]["momentum"]) == (
                r.param_groups[0]["lr"],
                r.param_groups[0]["momentum"],
            ), name
    assert_state_close(model, ref)
    assert len(g.compiled_steps) == 1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_a_scheduler_is_honoured_step_for_step(name):
    t = Twin(make_sch=SCHEDULERS[name])
    for x, y in _batches(5):
        t.step(x, y)
        for group, ref in zip(t.opt.param_groups, t.ref_opt.param_groups):
            assert group["lr"] == ref["lr"] and group["momentum"] == ref["momentum"]
    t.check()
    assert len(t.g.compiled_steps) == 1


def test_reduce_lr_on_plateau_is_refused_at_add_optimizer_with_the_alternative():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sch = lrs.ReduceLROnPlateau(opt, patience=0)

    class G(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt, lr_sch=sch)

    with pytest.raises(ConfigError, match=r"sch\.step\(metric\) yourself after g\(\.\.\.\)"):
        G()


def test_reduce_lr_on_plateau_stepped_outside_the_graph_works_as_eager():
    # threshold 0.5: a loss not 50% below the best so far counts as a plateau
    def make_sch(o):
        return lrs.ReduceLROnPlateau(
            o,
            patience=0,
            factor=0.5,
            threshold=0.5,
        )

    t = Twin()
    sch, ref_sch = make_sch(t.opt), make_sch(t.ref_opt)
    ((x, y),) = _batches(1)
    for _ in range(4):
        loss = t.step(x, y)
        sch.step(loss.item())
        ref_sch.step(loss.item())
        assert t.opt.param_groups[0]["lr"] == t.ref_opt.param_groups[0]["lr"]
    assert t.opt.param_groups[0]["lr"] < 0.1  # the scheduler did reduce it
    t.check()
    assert len(t.g.compiled_steps) == 1  # the lr is a graph input


# -- 5. optimizer state edits ------------------------------------------------------------------


def _sgd_damped(m):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.2)


def _adam(m):
    return torch.optim.Adam(m.parameters(), lr=0.01)


def _clear(opt):
    opt.state.clear()


def _replace(opt):
    p = opt.param_groups[0]["params"][0]
    key = "momentum_buffer" if "momentum_buffer" in opt.state[p] else "exp_avg"
    opt.state[p][key] = torch.full_like(p, 0.05)


def _delete_one(opt):
    del opt.state[opt.param_groups[0]["params"][1]]


def _new_dict(opt):
    p = opt.param_groups[0]["params"][0]
    opt.state[p] = {k: v.clone() * 0.5 for k, v in opt.state[p].items()}


@pytest.mark.parametrize(
    "make_opt, edit",
    [
        pytest.param(
            o,
            e,
            id=f"{e.__name__[1:]}-{o.__name__[1:]}",
            marks=() if (o, e) in {(_sgd_damped, _clear), (_adam, _replace)} else pytest.mark.slow,
        )
        for o in (_sgd_damped, _adam)
        for e in (_clear, _replace, _new_dict)
    ],
)
def test_an_optimizer_state_edit_is_honoured_as_eager(make_opt, edit):
    t = Twin(make_opt=make_opt)
    data = _batches(4)
    t.step(*data[0])
    t.step(*data[1])
    edit(t.opt)
    edit(t.ref_opt)
    t.step(*data[2])
    t.step(*data[3])
    t.check()


@pytest.mark.slow
@pytest.mark.parametrize(
    "make_opt",
    [lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), _adam],
    ids=["sgd", "adam"],
)
def test_one_parameters_state_deleted_is_honoured_as_eager(make_opt):
    t = Twin(make_opt=make_opt)
    data = _batches(3)
    t.step(*data[0])
    _delete_one(t.opt)
    _delete_one(t.ref_opt)
    t.step(*data[1])
    t.step(*data[2])
    t.check()


def test_one_parameters_state_deleted_with_dampening_is_honoured_as_eager():
    """eager SGD restarts that parameter's buffer alone, from its next gradient (undampened),
    while the others go on: so does the step (a flag per parameter)."""
    t = Twin(make_opt=_sgd_damped)
    data = _batches(3)
    t.step(*data[0])
    _delete_one(t.opt)
    _delete_one(t.ref_opt)
    t.step(*data[1])
    t.step(*data[2])
    t.check()
