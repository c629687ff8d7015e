"""Every Python value a step reads is checked, not only registered modules' attributes.

Each case trains the same model eagerly and through graphamp while the training loop changes a
Python value the step reads (a global, of build()'s module or read through another module of
the user's; a closure variable; a class attribute, read through an object or off the class; the
contents of a dict, dataclass or namespace; an attribute of an options object of the user's own
class) between calls. The step must follow eager (the value is honoured:
captured again, logged with its name, old and new value), and a value changed back reuses the
program it had.
"""

from __future__ import annotations

import argparse
import collections
import contextvars
import copy
import dataclasses
import functools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import make_graph

import graphamp
from graphamp.errors import CaptureError

INDUCTOR = pytest.mark.inductor

KL_WEIGHT = 0.0  # a module global the training loop anneals, read in forward()
LOSS_SCALE = 1.0  # a module global read in build()
STEP = 0  # a global counter build() increments (refused: it changes on every call)


class VAE(nn.Module):
    """A loss with a KL term weighted by a global, and a class attribute scaling the decoder."""

    temperature = 1.0  # a class attribute, changed on the class

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.dec = nn.Linear(4, 8)

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = h.chunk(2, dim=-1)
        recon = self.dec(mu) / self.temperature
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).mean()
        return F.mse_loss(recon, x) + KL_WEIGHT * kl


class Regularised(nn.Module):
    """Hyperparameters in containers held by the module: a dict, a dataclass, a namespace."""

    @dataclasses.dataclass
    class Config:
        l2: float = 0.0
        centred: bool = False

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.hp = {"reg": 0.0, "kind": "l1"}
        self.cfg = self.Config()
        self.args = argparse.Namespace(shift=0.0)
        self.schedule = [{"w": 1.0}, {"w": 0.5}]

    def forward(self, x):
        out = self.lin(x + self.args.shift)
        if self.cfg.centred:
            out = out - out.mean()
        penalty = out.abs().mean() if self.hp["kind"] == "l1" else out.pow(2).mean()
        weight = self.schedule[0]["w"]
        return weight * out.pow(2).mean() + self.hp["reg"] * penalty + self.cfg.l2 * x.sum() * 0


def _data():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=gen) for _ in range(6)]


def _train(model_cls, change, graph: bool, build=None, steps: int = 6, backend="aot_eager"):
    """Losses and final parameters of ``steps`` SGD steps; ``change(step, model)`` runs before
    each step (the training loop changing a value)."""
    torch.manual_seed(0)
    model = model_cls()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = None
    if graph:
        g = make_graph(model, lambda out, y: out, opt, build=build, backend=backend)
    losses = []
    for step, x in enumerate(_data()[:steps]):
        change(step, model)
        if g is not None:
            losses.append(g(x, None).detach().clone())
        else:
            opt.zero_grad(set_to_none=True)
            loss = build(_Eager(model), x, None) if build else model(x)
            if not build:
                loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
    params = [p.detach().clone() for p in model.parameters()]
    return losses, params, g


class _Eager:
    """Stands in for the Graph in an eager run of a build function."""

    def __init__(self, model):
        self.model = model


def _assert_like_eager(
    change, model_cls=VAE, build=None, caplog=None, expect=(), backend="aot_eager"
):
    """Eager and graphamp train alike under ``change``; graphamp logged each expected change."""
    reset = _globals()
    eager = _train(model_cls, change, graph=False, build=build)
    _restore(reset)
    with caplog.at_level(logging.INFO, logger="graphamp"):
        graphed = _train(model_cls, change, graph=True, build=build, backend=backend)
    _restore(reset)
    for a, b in zip(eager[0], graphed[0]):
        torch.testing.assert_close(a, b)
    for a, b in zip(eager[1], graphed[1]):
        torch.testing.assert_close(a, b)
    messages = [r.getMessage() for r in caplog.records]
    for words in expect:
        assert any(words in m for m in messages), (words, [m for m in messages if "again" in m])
    return graphed[2]


def _globals():
    return dict(KL_WEIGHT=KL_WEIGHT, LOSS_SCALE=LOSS_SCALE, STEP=STEP, t=VAE.temperature)


def _restore(saved):
    global KL_WEIGHT, LOSS_SCALE, STEP
    KL_WEIGHT, LOSS_SCALE, STEP = saved["KL_WEIGHT"], saved["LOSS_SCALE"], saved["STEP"]
    VAE.temperature = saved["t"]


def test_a_global_annealed_by_the_loop_and_read_in_forward_is_honoured(caplog):
    def anneal(step, model):
        global KL_WEIGHT
        KL_WEIGHT = min(1.0, step / 2)

    g = _assert_like_eager(
        anneal,
        caplog=caplog,
        expect=["global KL_WEIGHT", "changed from 0.0 to 0.5", "takes it as an input"],
    )
    # the first value is baked in; once it changed, it is an input of the step
    assert len(g.compiled_steps) == 2


def test_a_kl_weight_annealed_over_1000_steps_compiles_twice_and_equals_eager():
    def anneal(step, model):
        global KL_WEIGHT
        KL_WEIGHT = min(1.0, step / 1000)

    reset = _globals()
    try:
        eager = _train(VAE, anneal, graph=False, steps=1000)
        _restore(reset)
        losses, params, g = _train(VAE, anneal, graph=True, steps=1000)
    finally:
        _restore(reset)
    assert len(g.compiled_steps) == 2
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager[0]))
    for a, b in zip(params, eager[1]):
        torch.testing.assert_close(a, b)


def test_two_floats_annealed_together_are_lifted_by_one_build(caplog):
    """A KL weight and a temperature the loop changes at the same steps: the build their first
    change causes lifts both (it lifted the first only, and the next call compiled again)."""

    def anneal(step, model):
        global KL_WEIGHT
        KL_WEIGHT = min(1.0, step / 4)
        VAE.temperature = 1.0 + step / 8

    g = _assert_like_eager(anneal, caplog=caplog, expect=["VAE.temperature changed between"])
    lifted = [r.getMessage() for r in caplog.records if "changed between calls" in r.getMessage()]
    assert len(lifted) == 2 and any("global KL_WEIGHT" in m for m in lifted), lifted
    assert len(g.compiled_steps) == 2


class _Gained(nn.Module):
    gain = 1.0  # on the class; an instance may shadow it

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.slope = 0.01  # an op's argument: must stay a Python number

    def forward(self, x):
        return F.leaky_relu(self.lin(x), negative_slope=self.slope) * self.gain * KL_WEIGHT


class _GainedStep(graphamp.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
        self.config.set_backend("eager")
        self.config.set_step_cache(False)

    def build(self, x):
        loss = self.model(x).square().mean()
        loss.backward()
        return loss


def _check_gained(g, model, x):
    with torch.no_grad():
        expected = model(x).square().mean()
    torch.testing.assert_close(g(x), expected)


def test_a_lifted_class_attribute_shadowed_on_the_instance_later_is_honoured():
    """A class attribute lifted into a step input, then set on the instance: the instance
    was not checked (the trace read the stand-in and recorded nothing), so the step kept
    using the class's value (the fuzzer's seed 228)."""
    global KL_WEIGHT
    model, x = _Gained(), torch.randn(3, 4)
    g = _GainedStep(model)
    saved, KL_WEIGHT = KL_WEIGHT, 1.0
    try:
        _check_gained(g, model, x)
        _Gained.gain = 2.0  # changed: lifted from here on
        _check_gained(g, model, x)
        _Gained.gain = 3.0
        _check_gained(g, model, x)
        model.gain = 0.5  # the instance shadows the class
        _check_gained(g, model, x)
        assert len(g.compiled_steps) == 3
    finally:
        _Gained.gain, KL_WEIGHT = 1.0, saved


def test_a_float_needed_as_a_number_changed_with_an_annealed_one_demotes_only_itself(caplog):
    """Two floats changed at one call are lifted by one build; when build() needs one of
    them as a Python number, that one alone is baked in: the other stays a step input (both
    were baked in, and the annealed one compiled at every call: the fuzzer's seed 983)."""
    global KL_WEIGHT
    model, x = _Gained(), torch.randn(3, 4)
    g = _GainedStep(model)
    saved = KL_WEIGHT
    try:
        with caplog.at_level(logging.INFO, logger="graphamp"):
            for step in range(6):
                KL_WEIGHT = 0.5 + 0.1 * step
                if step == 1:
                    model.slope = 0.2
                _check_gained(g, model, x)
    finally:
        KL_WEIGHT = saved
    assert len(g.compiled_steps) == 2
    failed = [r.getMessage() for r in caplog.records if "as a step input failed" in r.getMessage()]
    assert len(failed) == 1 and "self.model.slope as a step input" in failed[0], failed


class Gated(VAE):
    """Branches on the KL weight in Python: it cannot be a step input."""

    def forward(self, x):
        loss = super().forward(x)
        return loss * 2 if KL_WEIGHT > 0.25 else loss


def test_a_float_build_branches_on_stays_baked_in_and_is_honoured(caplog):
    def anneal(step, model):
        global KL_WEIGHT
        KL_WEIGHT = step / 10

    g = _assert_like_eager(
        anneal, model_cls=Gated, caplog=caplog, expect=["needs it as a Python number"]
    )
    assert len(g.compiled_steps) == 6  # one per value: it decides a branch


@pytest.mark.inductor
def test_a_lifted_value_with_inductor(caplog):
    def anneal(step, model):
        global KL_WEIGHT
        KL_WEIGHT = step / 5

    reset = _globals()
    try:
        eager = _train(VAE, anneal, graph=False)
        _restore(reset)
        torch.manual_seed(0)
        model = VAE()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = make_graph(model, lambda out, y: out, opt, backend="inductor")
        losses = []
        for step, x in enumerate(_data()):
            anneal(step, model)
            losses.append(g(x, None).detach().clone())
    finally:
        _restore(reset)
    assert len(g.compiled_steps) == 2
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager[0]))


def test_a_global_read_in_build_is_honoured(caplog):
    def build(self, x, y):
        loss = self.model(x) * LOSS_SCALE
        loss.backward()
        return loss

    def change(step, model):
        global LOSS_SCALE
        LOSS_SCALE = 1.0 if step < 3 else 2.0

    _assert_like_eager(change, build=build, caplog=caplog, expect=["global LOSS_SCALE"])


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=INDUCTOR)])
def test_a_class_attribute_changed_on_the_class_is_honoured(backend, caplog):
    def change(step, model):
        VAE.temperature = 1.0 if step < 2 else 0.5

    _assert_like_eager(
        change,
        caplog=caplog,
        expect=["VAE.temperature changed from 1.0 to 0.5"],
        backend=backend,
    )


@pytest.mark.inductor
def test_a_dict_item_branch_with_inductor(caplog):
    def change(step, model):
        model.hp["kind"] = "l2" if step > 2 else "l1"

    _assert_like_eager(
        change, model_cls=Regularised, caplog=caplog, expect=["'l2'"], backend="inductor"
    )


def test_an_instance_attribute_shadowing_a_class_attribute_is_honoured(caplog):
    def change(step, model):
        if step == 3:
            model.temperature = 2.0

    _assert_like_eager(change, caplog=caplog, expect=["temperature was set on the instance"])


@pytest.mark.parametrize(
    "what, change, words",
    [
        ("dict item", lambda s, m: m.hp.update(reg=0.1 * s), "self.model.hp changed"),
        ("dict item, a branch", lambda s, m: m.hp.update(kind="l2" if s > 2 else "l1"), "'l2'"),
        ("dataclass field", lambda s, m: setattr(m.cfg, "centred", s > 2), "centred=True"),
        ("namespace field", lambda s, m: setattr(m.args, "shift", 0.5 * (s > 3)), "shift=0.5"),
        ("list of dicts", lambda s, m: m.schedule[0].update(w=2.0 if s > 1 else 1.0), "'w': 2.0"),
    ],
)
def test_contents_of_containers_changed_in_place_are_honoured(what, change, words, caplog):
    _assert_like_eager(change, model_cls=Regularised, caplog=caplog, expect=[words])


def _weighted_loss():
    """A loss made by a factory: its weight lives in a closure cell the setter rebinds."""
    weight = 1.0

    def loss(out):
        return out * weight

    def set_weight(value):
        nonlocal weight
        weight = value

    return loss, set_weight


def test_a_closure_variable_rebound_after_the_first_call_is_honoured(caplog):
    loss, set_weight = _weighted_loss()

    def build(self, x, y):
        out = loss(self.model(x))
        out.backward()
        return out

    def change(step, model):
        set_weight(1.0 if step < 2 else 3.0)

    _assert_like_eager(
        change, build=build, caplog=caplog, expect=["closure variable weight", "from 1.0 to 3.0"]
    )


@dataclasses.dataclass
class _Output(collections.OrderedDict):
    """The output class of diffusers (``BaseOutput``) and transformers (``ModelOutput``): a
    dataclass that is also a dict, whose ``__post_init__`` fills the dict from its fields and
    reads ``self`` in a generator (a closure variable of the generator's frame)."""

    sample: torch.Tensor
    extra: torch.Tensor | None = None

    def __post_init__(self):
        others_none = all(getattr(self, f.name) is None for f in dataclasses.fields(self)[1:])
        if others_none:
            self["sample"] = self.sample


class _WithOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _Output(sample=self.lin(x))


def test_an_output_record_made_in_forward_holding_a_traced_tensor_is_not_a_setting():
    # the generator's read of `self` (an _Output holding a traced tensor, its dict still empty)
    # was kept as a guard: a deep copy of the traced tensor, which torch refuses
    model, twin = _WithOutput(), _WithOutput()
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = make_graph(model, lambda out, y: F.mse_loss(out.sample, y), opt)
    eager_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for _ in range(3):
        x, y = torch.randn(2, 4), torch.randn(2, 4)
        loss = g(x, y)
        eager_opt.zero_grad()
        eager = F.mse_loss(twin(x).sample, y)
        eager.backward()
        eager_opt.step()
        torch.testing.assert_close(loss, eager.detach())
    assert len(g.compiled_steps) == 1


METRICS: dict = {}  # a global dict build() fills for logging, read after every call


class _Scaled(nn.Module):
    """Reads a table of constants from a global dict it fills on first use (a memo: a rotary or
    mask cache keyed by size), and fills a scratch dict it reads back in the same call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        table = _MEMO.setdefault(x.shape[-1], torch.linspace(0.5, 1.5, x.shape[-1]))
        _SCRATCH["h"] = self.lin(x) * table
        return _SCRATCH["h"].tanh()


_MEMO: dict = {}
_SCRATCH: dict = {}


def test_dict_entries_build_sets_in_globals_and_closures_hold_each_calls_tensors_as_in_eager():
    # they were put back after capture (an INFO line said so): METRICS stayed empty, silently,
    # where eager leaves each call's values there
    parts: dict = {}

    def build(self, x, y):
        out = self.model(x)
        loss = F.mse_loss(out, y)
        reg = out.pow(2).mean()
        METRICS["loss"] = loss.detach()
        parts["reg"] = reg.detach()  # a closure variable's dict
        (loss + 0.1 * reg).backward()
        return loss

    def run(graph: bool):
        torch.manual_seed(0)
        model = _Scaled()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = make_graph(model, None, opt, build=build) if graph else None
        seen = []
        for _ in range(3):
            x, y = torch.randn(2, 4), torch.randn(2, 4)
            if graph:
                g(x, y)
            else:
                opt.zero_grad()

                class Self:  # build's self, eagerly
                    pass

                me = Self()
                me.model = model
                build(me, x, y)
                opt.step()
            seen.append((METRICS["loss"].clone(), parts["reg"].clone(), _SCRATCH["h"].clone()))
        return seen, model, g

    eager, eager_model, _ = run(graph=False)
    METRICS.clear(), _MEMO.clear(), _SCRATCH.clear()
    graphed, model, g = run(graph=True)
    for (a, b, c), (d, e, f) in zip(eager, graphed):
        torch.testing.assert_close(a, d), torch.testing.assert_close(b, e)
        torch.testing.assert_close(c, f)
    for p, q in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(p, q)
    assert len(g.compiled_steps) == 1
    table = _MEMO[4]  # the memo holds a real tensor, made once, as eager's first call made it
    assert not isinstance(table, torch._subclasses.FakeTensor)
    torch.testing.assert_close(table, torch.linspace(0.5, 1.5, 4))
    METRICS.clear(), _MEMO.clear(), _SCRATCH.clear()


def test_a_tensor_put_inside_a_container_a_global_dict_already_held_is_refused():
    # the step can replay an entry of the dict itself, not a change inside the old container
    state = {"metrics": {}, "counts": collections.defaultdict(list)}

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        state["metrics"]["loss"] = loss.detach()
        loss.backward()
        return loss

    model = nn.Linear(4, 4)
    g = make_graph(model, None, torch.optim.SGD(model.parameters(), lr=0.1), build=build)
    with pytest.raises(CaptureError, match=r"inside closure variable state .*\['metrics'\]"):
        g(torch.randn(2, 4), torch.randn(2, 4))
    assert state["metrics"] == {}  # put back: no placeholder of the capture left behind


def test_a_value_changed_back_reuses_the_first_step():
    reset = _globals()
    try:
        _, _, g = _train(VAE, lambda s, m: _set_kl(0.5 if s == 2 else 0.0), graph=True)
    finally:
        _restore(reset)
    assert len(g.compiled_steps) == 2


def _set_kl(value):
    global KL_WEIGHT
    KL_WEIGHT = value


def test_a_training_step_function_honours_what_it_closes_over(caplog):
    """The function way: a global schedule value and a loss module the function closes over
    (never registered) whose label_smoothing the loop changes."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    twin = nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)

    @graphamp.training_step(model, opt)
    def train_step(x, y):
        loss = criterion(model(x), y) * LOSS_SCALE
        loss.backward()
        return loss

    train_step.config.set_backend("aot_eager")
    gen = torch.Generator().manual_seed(1)
    reset = _globals()
    try:
        with caplog.at_level(logging.INFO, logger="graphamp"):
            for step in range(5):
                _restore({**reset, "LOSS_SCALE": 1.0 + (step > 1)})
                criterion.label_smoothing = 0.2 if step > 2 else 0.0
                x, y = torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)
                got = train_step(x, y)
                twin_opt.zero_grad()
                want = criterion(twin(x), y) * LOSS_SCALE
                want.backward()
                twin_opt.step()
                torch.testing.assert_close(got, want.detach())
    finally:
        _restore(reset)
    torch.testing.assert_close(model.weight, twin.weight)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "global LOSS_SCALE" in messages
    assert "label_smoothing changed from 0.0 to 0.2" in messages


def test_a_global_counter_build_increments_is_refused_by_name():
    def build(self, x, y):
        global STEP
        STEP += 1
        loss = self.model(x)
        loss.backward()
        return loss

    reset = _globals()
    try:
        model = VAE()
        g = make_graph(model, None, torch.optim.SGD(model.parameters(), lr=0.1), build=build)
        with pytest.raises(CaptureError, match="STEP"):
            g(torch.randn(4, 8), None)
        assert STEP == reset["STEP"]  # put back: the user's state is as before the call
    finally:
        _restore(reset)


def test_a_nonlocal_write_in_build_is_refused_by_name():
    calls = 0

    def build(self, x, y):
        nonlocal calls
        calls += 1
        loss = self.model(x)
        loss.backward()
        return loss

    model = VAE()
    g = make_graph(model, None, torch.optim.SGD(model.parameters(), lr=0.1), build=build)
    with pytest.raises(CaptureError, match="closure variable 'calls'"):
        g(torch.randn(4, 8), None)


def test_a_global_function_rebound_is_honoured(caplog):
    """A global bound to another function (the loss swapped between phases)."""
    global _criterion
    saved = _criterion

    def build(self, x, y):
        loss = _criterion(self.model(x))
        loss.backward()
        return loss

    def change(step, model):
        global _criterion
        _criterion = _mean if step < 3 else _double_mean

    try:
        _assert_like_eager(change, build=build, caplog=caplog, expect=["global _criterion"])
    finally:
        _criterion = saved


def _mean(out):
    return out.mean()


def _double_mean(out):
    return 2 * out.mean()


_criterion = _mean


# -- float arguments of g(...) (issue 39): lifted as step inputs once they change ----------------


class ArgumentWeighted(nn.Module):
    """A VAE-like loss whose KL weight and temperature come as arguments, as a loop passes
    them: ``g(x, kl_weight=w, temperature=t)``."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.dec = nn.Linear(4, 8)

    def forward(self, x, kl_weight, temperature=1.0, how="plain"):
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).mean()
        if how == "gated":  # a Python branch on the number: it cannot be a step input
            kl = kl * 2 if kl_weight > 0.25 else kl
        if how == "slope":  # an op that takes it as a Python number
            mu = F.leaky_relu(mu, kl_weight)
        return F.mse_loss(self.dec(mu) / temperature, x) + kl_weight * kl


def _weighted_run(graph: bool, how="plain", steps=6, backend="aot_eager", amp=None):
    torch.manual_seed(0)
    model = ArgumentWeighted()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    class Step(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_backend(backend)
            if amp is not None:
                self.config.enable_amp(True, dtype=amp)

        def build(self, x, kl_weight, temperature=1.0):
            loss = self.model(x, kl_weight, temperature, how)
            loss.backward()
            return loss

    g = Step() if graph else None
    losses = []
    for step, x in enumerate((_data() * 200)[:steps]):
        w, t = step / steps, 1.0 + (step % 3) / 4  # both change; t comes back to old values
        if g is not None:
            losses.append(g(x, w, temperature=t).detach().clone())
        else:
            opt.zero_grad(set_to_none=True)
            loss = model(x, w, t, how)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], g


def test_float_arguments_that_change_become_step_inputs_like_eager(caplog):
    """A KL weight annealed over 300 calls and a temperature cycling through three values,
    passed as arguments: two compiles (the first values baked in, then both as inputs), no
    warning about baked-in numbers, and the losses and parameters eager's (fp32)."""
    eager = _weighted_run(graph=False, steps=300)
    with caplog.at_level(logging.INFO, logger="graphamp"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the baked-in numbers warning would raise
            losses, params, g = _weighted_run(graph=True, steps=300)
    assert len(g.compiled_steps) == 2
    # a 0-dim float32 tensor in place of a Python float: the same values, with at most an ulp
    # or two of difference in a few steps
    torch.testing.assert_close(losses, eager[0], rtol=1e-6, atol=0)
    for a, b in zip(params, eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "float argument(s) kl_weight, kw_temperature" in messages, messages


@pytest.mark.parametrize("how", ["gated", "slope"])
def test_a_float_argument_used_as_a_python_number_stays_baked_in_and_is_honoured(how, caplog):
    """A branch on the argument, or an op that takes it as a number: the lifted capture fails,
    the values are baked in again (one step per value, as before) and training equals eager."""
    eager = _weighted_run(graph=False, how=how)
    with caplog.at_level(logging.INFO, logger="graphamp"):
        losses, params, g = _weighted_run(graph=True, how=how)
    torch.testing.assert_close(losses, eager[0])
    for a, b in zip(params, eager[1]):
        torch.testing.assert_close(a, b)
    assert "needs them as Python numbers" in caplog.text
    if how == "gated":  # the failure names neither: both are baked in
        assert len(g.compiled_steps) >= 6  # every new (weight, temperature) pair compiles
    else:  # the failure names the slope: the temperature stays a step input
        assert "float argument(s) kl_weight as step inputs failed" in caplog.text
        assert len(g.compiled_steps) == 6  # one per weight, whatever the temperature


def test_int_and_bool_arguments_are_not_lifted():
    """Integers are sizes and indices, booleans switches: they stay part of the step's key."""

    class Step(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.add_optimizer(torch.optim.SGD(self.lin.parameters(), lr=0.1))
            self.config.set_backend("eager")

        def build(self, x, k, flip):
            out = self.lin(x)[:, :k]
            loss = (-out if flip else out).pow(2).mean()
            loss.backward()
            return loss

    g = Step()
    x = torch.randn(2, 4)
    for k, flip in [(1, False), (2, False), (2, True), (3, True)]:
        g(x, k, flip)
    assert len(g.compiled_steps) == 4 and not g._run.arg_lifting.lifted


@pytest.mark.inductor
def test_float_arguments_lifted_with_inductor_and_bf16():
    """The same annealed arguments with inductor and bf16 AMP: two compiles, and within bf16
    of eager fp32."""
    eager = _weighted_run(graph=False, steps=8)
    losses, _, g = _weighted_run(graph=True, steps=8, backend="inductor", amp=torch.bfloat16)
    assert len(g.compiled_steps) == 2
    torch.testing.assert_close(losses, eager[0], rtol=3e-2, atol=3e-3)


# -- objects and classes of the user's that build() reads settings off ----------------------


class Knobs:
    """A plain class of settings, read off the class (``Knobs.scale``)."""

    scale = 1.0


class MoreKnobs(Knobs):
    """Inherits ``scale``; may shadow it later."""


class Options:
    """A hand-written options object (no dataclass): its attributes are read off the object."""

    weight = 1.0  # a class attribute the object reads through itself

    def __init__(self):
        self.shift = 0.0
        self.calls = 0  # changed by the loop, never read by build()


OPTIONS = Options()


class SlottedOptions:
    """An options object with ``__slots__`` (no ``__dict__``): its values live in its slots."""

    __slots__ = ("shift", "calls")
    weight = 1.0  # a class attribute read through the object

    def __init__(self):
        self.shift = 0.0
        self.calls = 0


@dataclasses.dataclass(slots=True)
class SlottedHyper:
    """A dataclass of plain values with ``slots=True``: compared by its fields."""

    l2: float = 0.0
    centred: bool = False


SLOTTED = SlottedOptions()
SLOTTED_HYPER = SlottedHyper()


class WithOptions(nn.Module):
    """A module holding an options object of the user's class."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.opts = Options()

    def forward(self, x):
        return (self.lin(x + self.opts.shift) * self.opts.weight).pow(2).mean()


def _shadow_scale(value):
    """``MoreKnobs.scale`` set to ``value``, or inherited again (None): each step sets it, so
    the eager and the graphed run see the same."""
    if value is not None:
        MoreKnobs.scale = value
    elif "scale" in vars(MoreKnobs):
        del MoreKnobs.scale


def _knobs():
    return dict(scale=Knobs.scale, more=vars(MoreKnobs).get("scale"), weight=Options.weight)


def _put_back_knobs(saved):
    Knobs.scale, Options.weight = saved["scale"], saved["weight"]
    if saved["more"] is None and "scale" in vars(MoreKnobs):
        del MoreKnobs.scale
    OPTIONS.shift = SLOTTED.shift = 0.0
    SlottedOptions.weight = 1.0
    SLOTTED_HYPER.l2, SLOTTED_HYPER.centred = 0.0, False


def _scaled_options():
    """A build() reading a closure's options object, and the object."""
    opts = Options()

    def build(self, x, y):
        loss = self.model(x) * (1 + opts.shift)
        loss.backward()
        return loss

    return build, opts


@pytest.mark.parametrize(
    "what, read, change, words",
    [
        (
            "a class attribute read off a global class",
            lambda: Knobs.scale,
            lambda s: setattr(Knobs, "scale", 2.0 if s > 2 else 1.0),
            "Knobs.scale changed from 1.0 to 2.0",
        ),
        (
            "an inherited one read off the subclass, changed on the base",
            lambda: MoreKnobs.scale,
            lambda s: setattr(Knobs, "scale", 3.0 if s > 1 else 1.0),
            "Knobs.scale changed from 1.0 to 3.0",
        ),
        (
            "an inherited one shadowed on the subclass",
            lambda: MoreKnobs.scale,
            lambda s: _shadow_scale(0.5 if s > 2 else None),
            "MoreKnobs.scale was set on the subclass to 0.5",
        ),
        (
            "an attribute of a global options object",
            lambda: 1 + OPTIONS.shift,
            lambda s: setattr(OPTIONS, "shift", 0.25 * (s > 2)),
            "OPTIONS.shift changed from 0.0 to 0.25",
        ),
        (
            "a class attribute read through a global options object",
            lambda: OPTIONS.weight,
            lambda s: setattr(Options, "weight", 2.0 if s > 3 else 1.0),
            "Options.weight changed from 1.0 to 2.0",
        ),
        (
            "a slot of a global object with __slots__",
            lambda: 1 + SLOTTED.shift,
            lambda s: setattr(SLOTTED, "shift", 0.25 * (s > 2)),
            "SLOTTED.shift changed from 0.0 to 0.25",
        ),
        (
            "a class attribute read through an object with __slots__",
            lambda: SLOTTED.weight,
            lambda s: setattr(SlottedOptions, "weight", 2.0 if s > 3 else 1.0),
            "SlottedOptions.weight changed from 1.0 to 2.0",
        ),
        (
            "a field of a global dataclass(slots=True), changed in place",
            lambda: 1 + SLOTTED_HYPER.l2 + (0.5 if SLOTTED_HYPER.centred else 0.0),
            lambda s: (
                setattr(SLOTTED_HYPER, "l2", 0.1 * (s > 1)),
                setattr(SLOTTED_HYPER, "centred", s > 3),
            ),
            "changed from SlottedHyper(l2=0.0, centred=False) to SlottedHyper(l2=0.1, centred=False)",
        ),
    ],
)
def test_settings_on_the_users_classes_and_objects_are_honoured(what, read, change, words, caplog):
    def build(self, x, y):
        loss = self.model(x) * read()
        loss.backward()
        return loss

    saved = _knobs()
    try:
        _assert_like_eager(lambda s, m: change(s), build=build, caplog=caplog, expect=[words])
    finally:
        _put_back_knobs(saved)


def test_an_options_object_a_closure_holds_is_honoured(caplog):
    build, opts = _scaled_options()

    def change(step, model):
        opts.shift = 0.5 if step > 1 else 0.0

    _assert_like_eager(change, build=build, caplog=caplog, expect=["opts.shift changed"])


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=INDUCTOR)])
def test_an_options_object_a_module_holds_is_honoured(backend, caplog):
    def change(step, model):
        model.opts.shift = 0.1 * (step > 2)
        if step > 3:
            model.opts.weight = 2.0  # shadows the class attribute it read until now

    _assert_like_eager(
        change,
        model_cls=WithOptions,
        caplog=caplog,
        backend=backend,
        expect=[
            "self.model.opts.shift changed from 0.0 to 0.1",
            "self.model.opts.weight was set on the instance to 2.0",
        ],
    )


class WithSlottedOptions(WithOptions):
    """The same module, its options object one with ``__slots__``."""

    def __init__(self):
        super().__init__()
        self.opts = SlottedOptions()


def test_an_options_object_with_slots_a_module_holds_is_honoured(caplog):
    def change(step, model):
        model.opts.shift = 0.1 * (step > 2)
        model.opts.calls += 1  # a slot build() never reads: changes nothing

    graph = _assert_like_eager(
        change,
        model_cls=WithSlottedOptions,
        caplog=caplog,
        expect=["self.model.opts.shift changed from 0.0 to 0.1"],
    )
    assert len(graph.compiled_steps) == 2


def test_an_options_object_the_graph_holds_is_honoured():
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opts = Options()
    g = make_graph(
        model,
        None,
        torch.optim.SGD(model.parameters(), lr=0.0),
        build=lambda self, x, y: _backward(self.model(x).sum() * (1 + self.opts.shift)),
        configure=lambda graph: setattr(graph, "opts", opts),
    )
    x = torch.ones(2, 8)
    first = g(x, None)
    opts.shift = 1.0
    torch.testing.assert_close(g(x, None), 2 * first)


def _backward(loss):
    loss.backward()
    return loss


def test_what_build_does_not_read_and_librarys_objects_compile_nothing_new():
    """Only the attributes build() reads are checked, and only on the user's own objects: the
    loop's counter on an options object, and a logger (Python's class, whose level cache fills
    as it is asked) change on every step without a new compile."""
    import logging as logging_module

    log = logging_module.getLogger("graphamp.tests.quiet")

    def build(self, x, y):
        if log.isEnabledFor(logging_module.DEBUG):  # fills the logger's cache
            log.debug("step")
        loss = self.model(x) * OPTIONS.weight
        loss.backward()
        return loss

    def change(step, model):
        OPTIONS.calls += 1
        log.setLevel(logging_module.DEBUG if step % 2 else logging_module.INFO)  # clears it

    _, _, g = _train(VAE, change, graph=True, build=build)
    assert len(g.compiled_steps) == 1


_settings = None  # a module of the user's, imported by the test (``import settings``)


def test_a_global_of_another_module_of_the_users_read_through_it_is_honoured(
    tmp_path, monkeypatch, caplog
):
    """``import settings`` then ``settings.kl_weight`` in build(): a global of that module."""
    global _settings
    (tmp_path / "graphamp_test_settings.py").write_text("kl_weight = 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import graphamp_test_settings

    _settings = graphamp_test_settings

    def build(self, x, y):
        loss = self.model(x) * _settings.kl_weight
        loss.backward()
        return loss

    def change(step, model):
        _settings.kl_weight = 0.5 if step > 2 else 1.0

    _assert_like_eager(
        change, build=build, caplog=caplog, expect=["global kl_weight (graphamp_test_settings)"]
    )


HYPER = {"w": 1.0, "act": torch.tanh}  # numbers beside a function: a mixed container
LOSS_FN = functools.partial(torch.mul, other=1.0)  # a loss made with functools.partial
REGISTRY = {"tanh": torch.tanh}  # functions only: a registry the loop changes
ORDERED = collections.OrderedDict(w=1.0)  # a dict subclass of hyperparameters


@pytest.mark.parametrize(
    "what, read, change, words",
    [
        (
            "a number in a global dict that holds a function",
            lambda out: HYPER["act"](out) * HYPER["w"],
            lambda s: HYPER.update(w=2.0 if s > 2 else 1.0),
            "'w': 2.0",
        ),
        (
            "a function in it swapped",
            lambda out: HYPER["act"](out),
            lambda s: HYPER.update(act=torch.sigmoid if s > 2 else torch.tanh),
            "global HYPER",
        ),
        (
            "a number in a global OrderedDict",
            lambda out: out * ORDERED["w"],
            lambda s: ORDERED.update(w=2.0 if s > 2 else 1.0),
            "global ORDERED",
        ),
        (
            "a global partial rebound",
            lambda out: LOSS_FN(out),
            lambda s: globals().update(LOSS_FN=functools.partial(torch.mul, other=1.0 + (s > 1))),
            "global LOSS_FN",
        ),
    ],
)
def test_containers_holding_objects_and_partials_are_honoured(what, read, change, words, caplog):
    def build(self, x, y):
        loss = read(self.model(x))
        loss.backward()
        return loss

    saved = dict(HYPER), LOSS_FN
    ORDERED["w"] = 1.0
    try:
        _assert_like_eager(lambda s, m: change(s), build=build, caplog=caplog, expect=[words])
    finally:
        _put_back_hyper(saved)


def _put_back_hyper(saved):
    global LOSS_FN
    HYPER.clear()
    HYPER.update(saved[0])
    LOSS_FN = saved[1]


def test_a_dict_of_functions_changed_in_place_is_honoured(caplog):
    """A container of objects only is kept by its contents too (each object by identity): an
    entry replaced in place, or one added (build() may iterate over it), captures again."""

    def build(self, x, y):
        loss = sum(f(self.model(x)) for f in REGISTRY.values())
        loss.backward()
        return loss

    def change(step, model):
        if step == 2:
            REGISTRY["tanh"] = torch.sigmoid
        if step == 4:
            REGISTRY["relu"] = torch.relu

    try:
        with caplog.at_level(logging.INFO, logger="graphamp"):
            losses, params, g = _train(VAE, change, graph=True, build=build)
    finally:
        REGISTRY.clear()
        REGISTRY["tanh"] = torch.tanh
    try:
        eager = _train(VAE, change, graph=False, build=build)
    finally:
        REGISTRY.clear()
        REGISTRY["tanh"] = torch.tanh
    torch.testing.assert_close((losses, params), eager[:2], rtol=1e-5, atol=1e-6)
    assert len(g.compiled_steps) == 3
    assert "global REGISTRY (test_python_values) changed" in caplog.text


class WithGain(nn.Module):
    """A module with a plain tensor attribute (not a buffer) the loop binds to a new tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gain = torch.ones(8)

    def forward(self, x):
        return (self.lin(x) * self.gain).pow(2).mean()


def test_a_plain_tensor_attribute_bound_to_another_tensor_is_honoured(caplog):
    """Its values are read live (an input of the step); bound to a new tensor, the step is
    captured again, where it kept reading the old one."""

    def change(step, model):
        if step == 3:
            model.gain = torch.full((8,), 2.0)

    _assert_like_eager(change, model_cls=WithGain, caplog=caplog, expect=["self.model.gain"])


def test_numpy_scalars_a_schedule_gives_are_honoured(caplog):
    np = pytest.importorskip("numpy")
    schedule = np.linspace(0.5, 2.0, 6, dtype=np.float32)  # np.float32 values
    values = {"beta": schedule[0]}

    def build(self, x, y):
        loss = self.model(x) * values["beta"]
        loss.backward()
        return loss

    def change(step, model):
        values["beta"] = schedule[step // 3]

    _assert_like_eager(
        change, build=build, caplog=caplog, expect=["closure variable values", "np.float32(0.8)"]
    )


def test_a_mixed_dict_with_the_same_values_in_another_order_reuses_the_step():
    saved = dict(HYPER), LOSS_FN

    def build(self, x, y):
        loss = HYPER["act"](self.model(x)) * HYPER["w"]
        loss.backward()
        return loss

    def change(step, model):
        last = "w" if step % 2 else "act"
        HYPER[last] = HYPER.pop(last)  # the same values, the keys in another order

    try:
        _, _, g = _train(VAE, change, graph=True, build=build)
    finally:
        _put_back_hyper(saved)
    assert len(g.compiled_steps) == 1


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_kl_weight_from_a_numpy_schedule_compiles_twice_and_equals_eager(dtype, caplog):
    """np.linspace's values, numpy floats, are lifted as inputs as Python floats are."""
    np = pytest.importorskip("numpy")
    schedule = np.linspace(0.0, 1.0, 6, dtype=dtype)

    def anneal(step, model):
        global KL_WEIGHT
        KL_WEIGHT = schedule[step]

    g = _assert_like_eager(anneal, caplog=caplog, expect=["takes it as an input"])
    assert len(g.compiled_steps) == 2


@dataclasses.dataclass
class Bench:
    """A dataclass of the user's holding data and functions beside a name: watched, not copied."""

    name: str
    loss: object
    batches: list


def test_a_dataclass_of_data_and_functions_checks_only_the_fields_build_reads():
    bench = Bench("run", torch.tanh, [torch.randn(4, 8) for _ in range(200)])

    def build(self, x, y):
        loss = bench.loss(self.model(x))
        loss.backward()
        return loss

    def change(step, model):
        bench.name = f"run {step}"  # never read by build(): compiles nothing
        bench.batches.append(torch.zeros(1))
        if step == 3:
            bench.loss = torch.sigmoid  # read: captured again

    _, _, g = _train(VAE, change, graph=True, build=build)
    assert len(g.compiled_steps) == 2


# a script given to Python as text, the way a console, ``python -`` and ``python -c`` run it
_TEXT_SCRIPT = """
import torch, torch.nn as nn, graphamp
SCALE = 1.0
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
    def forward(self, x):
        return self.lin(x) * SCALE
model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.0)
class Train(graphamp.Graph):
    def __init__(self):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.set_backend("eager")
    def build(self, x):
        loss = self.model(x).sum()
        loss.backward()
        return loss
g, x = Train(), torch.randn(2, 3)
first = float(g(x))
SCALE = 2.0
print(round(float(g(x)) / first, 4), len(g.compiled_steps))
"""


@pytest.mark.parametrize("how", ["stdin", "-c"])
def test_a_script_run_from_text_has_its_globals_watched(how):
    """Code compiled from text has no file (``<stdin>``, ``<string>``): it is the user's where
    it runs in the user's ``__main__``, and a global it reads is a setting as a file's is."""
    import subprocess
    import sys

    command = [sys.executable, "-"] if how == "stdin" else [sys.executable, "-c", _TEXT_SCRIPT]
    stdin = _TEXT_SCRIPT if how == "stdin" else None
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2.0", "2"]  # the new value, in a second program


def test_code_compiled_from_text_in_a_module_is_watched():
    """A helper made with exec in this module's globals reads a global: changing it builds the
    step again, as for a helper written in the file."""
    namespace = globals()
    exec(compile("def _scaled(y):\n    return y * _TEXT_SCALE\n", "<string>", "exec"), namespace)
    namespace["_TEXT_SCALE"] = 1.0
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def build(g, x, y):
        loss = namespace["_scaled"](g.model(x)).sum()
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    x = torch.randn(2, 3)
    first = float(g(x, x))
    namespace["_TEXT_SCALE"] = 3.0
    assert float(g(x, x)) == pytest.approx(3 * first, rel=1e-5)


# -- a library's objects: what the user's code reads on them is a setting; their own code's
# reads (locks, caches, counters) are not

HANDLER = logging.Handler()  # a library's object held in a global (a scheduler, a tokenizer)


class _HandlerStep(graphamp.Graph):
    """build() reads a library object's attribute and property through ``self`` and through a
    global, and calls its methods (whose own reads are the library's)."""

    def __init__(self, handler: logging.Handler):
        super().__init__()
        self.model = nn.Linear(4, 2)
        self.handler = handler
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.0))
        self.config.set_backend("eager")
        self.config.set_step_cache(False)

    def build(self, x):
        self.handler.acquire()  # logging's own code reads self.lock
        self.handler.release()
        sigma = self.handler.sigma
        on = 2.0 if HANDLER.name == "on" else 1.0  # a property of the library's class
        loss = self.model(x).square().mean() * sigma * on
        loss.backward()
        return loss


def _handler_loss(handler: logging.Handler, model: nn.Linear, x: torch.Tensor) -> float:
    on = 2.0 if HANDLER.name == "on" else 1.0
    with torch.no_grad():
        return float(model(x).square().mean() * handler.sigma * on)


def test_a_library_objects_attribute_and_property_the_users_code_reads_are_honoured(caplog):
    import threading

    handler = logging.Handler()
    handler.sigma = 1.5
    HANDLER.name = "on"
    g = _HandlerStep(handler)
    x = torch.randn(3, 4)
    try:
        with caplog.at_level(logging.INFO, logger="graphamp"):
            assert float(g(x)) == pytest.approx(_handler_loss(handler, g.model, x))
            handler.sigma = 0.5  # what a training loop changes (a scheduler's sigma)
            assert float(g(x)) == pytest.approx(_handler_loss(handler, g.model, x))
            HANDLER.name = "off"  # through the class's property
            assert float(g(x)) == pytest.approx(_handler_loss(handler, g.model, x))
            compiled = len(g.compiled_steps)
            handler.lock = threading.RLock()  # the library's own state: read by its code only
            assert float(g(x)) == pytest.approx(_handler_loss(handler, g.model, x))
        assert compiled == 3 and len(g.compiled_steps) == compiled
        assert "self.handler.sigma" in caplog.text and "HANDLER.name" in caplog.text
    finally:
        HANDLER.name = None


def test_a_diffusers_schedulers_config_and_attributes_read_in_build_are_honoured():
    diffusers = pytest.importorskip("diffusers")
    sched = diffusers.DDPMScheduler(num_train_timesteps=100)

    class Step(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = nn.Linear(4, 2)
            self.sched = sched
            self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.0))
            self.config.set_backend("eager")
            self.config.set_step_cache(False)

        def build(self, x):
            n = self.sched.config.num_train_timesteps  # a property, then a FrozenDict's key
            loss = self.model(x).square().mean() * n * sched.init_noise_sigma
            loss.backward()
            return loss

    @torch.no_grad()
    def eager(model, x):
        return float(
            model(x).square().mean() * sched.config.num_train_timesteps * sched.init_noise_sigma
        )

    g = Step()
    x = torch.randn(3, 4)
    assert float(g(x)) == pytest.approx(eager(g.model, x))
    sched.init_noise_sigma = 2.0
    assert float(g(x)) == pytest.approx(eager(g.model, x))
    sched.register_to_config(num_train_timesteps=50)
    assert float(g(x)) == pytest.approx(eager(g.model, x))
    assert len(g.compiled_steps) == 3


class _ConfigReader(graphamp.Graph):
    """build() weighs its loss by ``self.cfg.loss.weight``, a config of the user's kind."""

    def __init__(self, cfg):
        super().__init__()
        self.model, self.cfg = nn.Linear(4, 2), cfg
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.0))
        self.config.set_backend("eager")
        self.config.set_step_cache(False)

    def build(self, x):
        loss = self.model(x).square().mean() * self.cfg.loss.weight
        loss.backward()
        return loss


@pytest.mark.parametrize("package", ["ml_collections", "omegaconf"])
def test_a_config_packages_fields_read_in_build_are_honoured(package):
    """ml_collections' ConfigDict serves ``cfg.loss.weight`` from its own ``__getattr__``: the
    read was baked in (the first value at every call). omegaconf's DictConfig, as a mapping,
    is compared by its contents."""
    pytest.importorskip(package)
    if package == "ml_collections":
        import ml_collections

        cfg = ml_collections.ConfigDict({"loss": {"weight": 0.5}})
    else:
        import omegaconf

        cfg = omegaconf.OmegaConf.create({"loss": {"weight": 0.5}})
    g, x = _ConfigReader(cfg), torch.randn(3, 4)
    for weight in (0.5, 0.25, 2.0, 0.25):
        cfg.loss.weight = weight
        with torch.no_grad():
            eager = float(g.model(x).square().mean() * weight)
        assert float(g(x)) == pytest.approx(eager)
    if package == "ml_collections":
        cfg.loss = ml_collections.ConfigDict({"weight": 3.0})  # a new node
        with torch.no_grad():
            eager = float(g.model(x).square().mean() * 3.0)
        assert float(g(x)) == pytest.approx(eager)


# -- a ContextVar's value, read in forward() through a global and a closure, and in build()

SCALE_VAR = contextvars.ContextVar("scale", default=1.0)
MODE_VAR = contextvars.ContextVar("mode")


def test_a_context_variables_value_read_by_the_step_is_honoured():
    flag = contextvars.ContextVar("flag", default=False)

    class Scaled(nn.Linear):
        def forward(self, x):
            y = super().forward(x) * SCALE_VAR.get()
            return y * 3.0 if flag.get() else y

    model = Scaled(4, 2)

    class Step(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
            self.config.set_backend("eager")
            self.config.set_step_cache(False)

        def build(self, x):
            loss = self.model(x).square().mean()
            loss = loss * (2.0 if MODE_VAR.get("train") == "eval" else 1.0)
            loss.backward()
            return loss

    @torch.no_grad()
    def eager(x):
        return float(model(x).square().mean() * (2.0 if MODE_VAR.get("train") == "eval" else 1.0))

    def changes():
        yield lambda: SCALE_VAR.set(2.0)
        yield lambda: flag.set(True)
        yield lambda: MODE_VAR.set("eval")

    context = contextvars.copy_context()  # the module's variables set here stay here

    def run() -> None:
        g, x = Step(), torch.randn(3, 4)
        assert float(g(x)) == pytest.approx(eager(x))
        for change in changes():
            change()
            assert float(g(x)) == pytest.approx(eager(x))
        assert len(g.compiled_steps) == 4

    context.run(run)


WEIGHT_VAR = contextvars.ContextVar("weight", default=0.5)
SHIFT = 0.0


def test_an_annealed_context_variable_is_lifted_and_graphamp_leaves_the_context_as_found():
    """A float ContextVar changed at every call is a step input after its first change (as a
    global would be); a later build for another change keeps it one, and the trace's stand-in
    never stays set in the user's context (the fuzzer's seed 1189 compiled on every call after
    such a build: its guard had recorded the stand-in)."""
    model = nn.Linear(4, 2)

    class Step(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
            self.config.set_backend("eager")
            self.config.set_step_cache(False)

        def build(self, x):
            loss = (self.model(x) + SHIFT).square().mean() * WEIGHT_VAR.get()
            loss.backward()
            return loss

    @torch.no_grad()
    def eager(x):
        return float((model(x) + SHIFT).square().mean() * WEIGHT_VAR.get())

    def run() -> None:
        global SHIFT
        g, x = Step(), torch.randn(3, 4)
        assert float(g(x)) == pytest.approx(eager(x))
        assert WEIGHT_VAR not in contextvars.copy_context()  # the trace set nothing
        for step, weight in enumerate([0.25, 0.125, 0.75, 0.5, 1.5]):
            WEIGHT_VAR.set(weight)
            if step == 2:
                SHIFT = 1.0  # a build that keeps the variable lifted
            assert float(g(x)) == pytest.approx(eager(x), rel=1e-6)
            assert WEIGHT_VAR.get() == weight  # the stand-in was taken back
        assert len(g.compiled_steps) == 3  # the first, the weight's first change, the shift

    try:
        contextvars.copy_context().run(run)
    finally:
        globals()["SHIFT"] = 0.0


class _GroupReader(graphamp.Graph):
    """A step whose build() reads its optimizer's lr as a Python number (to log it, to weigh
    its loss by it) and returns it."""

    def __init__(self, model, opt, sch):
        super().__init__()
        self.model, self.opt = model, opt
        self.add_optimizer(opt, lr_sch=sch)
        self.config.set_backend("eager")
        self.config.set_step_cache(False)

    def build(self, x):
        lr = self.opt.param_groups[0]["lr"]
        loss = self.model(x).square().mean()
        loss.backward()
        return loss, lr, loss * lr


def test_an_lr_build_reads_from_the_param_groups_is_this_steps_as_in_eager():
    """build() reading ``param_groups[0]["lr"]`` as a number got the first call's lr at every
    step; now it is the step's own (a scheduler's), a lifted step input after its first change
    (two compiles in all), returned as the Python float eager returns."""

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g, x = _GroupReader(model, opt, schedule(opt)), torch.randn(3, 4)
    eager_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    eager_sch = schedule(eager_opt)
    for _ in range(5):
        loss, lr, weighted = g(x)
        eager_opt.zero_grad()
        eager_lr = eager_opt.param_groups[0]["lr"]
        eager_loss = twin(x).square().mean()
        eager_loss.backward()
        assert type(lr) is float and lr == eager_lr
        torch.testing.assert_close(weighted, eager_loss.detach() * eager_lr)
        eager_opt.step()
        eager_sch.step()
    assert len(g.compiled_steps) == 2
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)


def test_an_lr_build_reads_from_its_scheduler_is_this_steps_as_in_eager():
    """``scheduler.get_last_lr()[0]`` (as Lightning's training_step logs it) read the first
    call's list at every step: its method reads it, not the user's code."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    class Step(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model, self.sch = model, sch
            self.add_optimizer(opt, lr_sch=sch)
            self.config.set_backend("eager")
            self.config.set_step_cache(False)

        def build(self, x):
            lr = self.sch.get_last_lr()[0]
            loss = self.model(x).square().mean()
            loss.backward()
            return loss * lr, lr

    x = torch.randn(3, 4)
    g = Step()
    for _ in range(5):
        expected = sch.get_last_lr()[0]
        with torch.no_grad():
            weighted = model(x).square().mean() * expected
        out, lr = g(x)
        assert type(lr) is float and lr == expected
        torch.testing.assert_close(out, weighted)
    assert len(g.compiled_steps) == 2
    assert type(sch.get_last_lr()) is list  # the user's list, outside a capture


def test_an_lr_read_through_accelerates_optimizer_wrapper_is_lifted():
    """accelerate's AcceleratedOptimizer serves ``param_groups`` from a property: read as a
    library object's property, the lr compiled a step at every scheduler step."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    try:
        wrapped = accelerate.Accelerator(cpu=True).prepare_optimizer(opt)
        assert "param_groups" not in vars(wrapped)
        g, x = _GroupReader(model, wrapped, None), torch.randn(3, 4)
        for _ in range(4):
            expected = opt.param_groups[0]["lr"]
            assert g(x)[1] == expected
            sch.step()
        assert len(g.compiled_steps) == 2
    finally:  # accelerate keeps its state process-wide
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_an_optimizer_of_the_users_own_class_has_its_group_entries_read_by_build_guarded():
    class Halving(torch.optim.SGD):  # defined here: the user's class
        pass

    model = nn.Linear(4, 2)
    opt = Halving(model.parameters(), lr=0.1)
    g, x = _GroupReader(model, opt, None), torch.randn(3, 4)
    assert g(x)[1] == 0.1
    opt.param_groups[0]["lr"] = 0.05
    assert g(x)[1] == 0.05
    opt.param_groups[0]["lr"] = 0.025
    assert g(x)[1] == 0.025
    assert len(g.compiled_steps) == 2


def test_build_setting_a_param_group_entry_is_refused_with_the_way_through():
    """The step passes the optimizer its groups before build() runs: a value build() sets
    would be used a step late and only at capture (it also left the trace's stand-in in the
    group when the value was a lifted float)."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    class Warmup(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model, self.opt = model, opt
            self.add_optimizer(opt)
            self.config.set_backend("eager")
            self.config.set_step_cache(False)
            self.lr_now = 0.01

        def build(self, x):
            for group in self.opt.param_groups:
                group["lr"] = self.lr_now
            loss = self.model(x).square().mean()
            loss.backward()
            return loss

    with pytest.raises(graphamp.CaptureError, match=r"sets self\.opt\.param_groups\[0\]\['lr'\]"):
        Warmup()(torch.randn(3, 4))
    assert opt.param_groups[0]["lr"] == 0.1 and type(opt.param_groups[0]) is dict
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
