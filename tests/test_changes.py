"""Every change a user makes between calls is seen by the next step, or refused by a
graphamp error that names it; never ignored. Each case is compared with eager PyTorch."""

from __future__ import annotations

import copy
import logging
import math
import threading
import warnings

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    Twin,
    assert_optimizer_close,
    assert_state_close,
    assert_unchanged,
    autocast_step,
    eager_step,
    make_graph,
    snapshot,
)
from models import seed_mlp

import graphamp
from graphamp import CaptureError, ConfigError


def _batches(n=4):
    return models.batches(n, 16, 256, 10, seed=0)


# -- 1. optimizer hyperparameters -----------------------------------------------------------------


def test_a_tensor_lr_changed_in_place_is_honoured_without_recompiling():
    t = Twin(seed_mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1)))
    data = _batches()
    t.step(*data[0])
    for opt in (t.opt, t.ref_opt):
        opt.param_groups[0]["lr"].fill_(0.02)  # the tensor itself, changed in place
    t.step(*data[1])
    t.check()
    assert len(t.g.compiled_steps) == 1


@pytest.mark.parametrize("change", ["lr", "momentum", "weight_decay", "dampening"])
def test_sgd_hyperparameters_changed_between_calls_are_honoured(change):
    values = {"lr": 0.01, "momentum": 0.5, "weight_decay": 0.01, "dampening": 0.3}
    t = Twin(
        seed_mlp(),
        lambda m: torch.optim.SGD(
            m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3, dampening=0.1
        ),
    )
    data = _batches()
    t.step(*data[0])
    for opt in (t.opt, t.ref_opt):
        opt.param_groups[0][change] = values[change]
    t.step(*data[1])
    t.step(*data[2])
    t.check()
    assert len(t.g.compiled_steps) == 1  # values are graph inputs


@pytest.mark.parametrize(
    "change, value", [("betas", (0.5, 0.9)), ("eps", 1e-3), ("weight_decay", 0.2), ("lr", 3e-4)]
)
def test_adam_hyperparameters_changed_between_calls_are_honoured(change, value):
    t = Twin(seed_mlp(), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    data = _batches()
    t.step(*data[0])
    for opt in (t.opt, t.ref_opt):
        opt.param_groups[0][change] = value
    t.step(*data[1])
    t.check()


def test_optimizer_load_state_dict_rolls_back_and_later_changes_are_honoured():
    t = Twin(seed_mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    data = _batches(5)
    t.step(*data[0])
    saved_model = copy.deepcopy(t.model.state_dict())
    saved = copy.deepcopy(t.opt.state_dict())
    t.step(*data[1])
    # roll back both: model and optimizer, to the state after step 0, with another lr
    for model, opt in ((t.model, t.opt), (t.ref, t.ref_opt)):
        model.load_state_dict(saved_model)
        # replaces the param_groups dicts; a copy each: torch's load keeps the loaded tensors
        # when their device and dtype already fit, so two optimizers would share them
        opt.load_state_dict(copy.deepcopy(saved))
        opt.param_groups[0]["lr"] = 0.03
    t.step(*data[2])
    for opt in (t.opt, t.ref_opt):
        opt.param_groups[0]["momentum"] = 0.5
    t.step(*data[3])
    t.check()


# -- 2. parameters changed outside the step --------------------------------------------------------

EDITS = {
    "p.data in place": lambda m: [p.data.clamp_(-0.01, 0.01) for p in m.parameters()],
    "p.data assigned": lambda m: setattr(m[0].weight, "data", torch.full_like(m[0].weight, 0.02)),
    "nn.init": lambda m: nn.init.normal_(
        m[0].weight, std=0.5, generator=torch.Generator().manual_seed(0)
    ),
    "load_state_dict": lambda m: m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()}),
    "no_grad in place": lambda m: _no_grad_scale(m),
}


def _no_grad_scale(m):
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.5)


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_parameters_edited_outside_the_step_are_seen_in_every_precision(edit, amp):
    """WGAN's weight clipping, manual surgery, re-initialisation, checkpoint loads."""
    t = Twin(seed_mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), amp=amp)
    data = _batches()
    tol = {} if amp is None else {"rtol": 2e-2, "atol": 2e-2}
    t.step(*data[0], **tol)
    EDITS[edit](t.model)
    EDITS[edit](t.ref)
    t.step(*data[1], **tol)  # the forward reads the edited weights, in low precision too
    t.step(*data[2], **tol)
    t.check(**tol)


# -- 3. structure ---------------------------------------------------------------------------------


def _structure_twin():
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
    return Twin(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))


def test_a_layer_appended_after_the_first_call_recaptures_and_says_why(caplog):
    t = _structure_twin()
    data = _batches()
    t.step(*data[0])
    torch.manual_seed(3)
    t.model.append(nn.Linear(10, 10))
    torch.manual_seed(3)
    t.ref.append(nn.Linear(10, 10))
    for m, opt in ((t.model, t.opt), (t.ref, t.ref_opt)):
        opt.add_param_group({"params": list(m[3].parameters())})
    with caplog.at_level(logging.INFO, logger="graphamp"):
        t.step(*data[1])
    t.check()
    assert any("registered modules changed" in r.getMessage() for r in caplog.records)


def test_a_layer_replaced_after_the_first_call_trains_the_new_layer():
    t = _structure_twin()
    data = _batches()
    t.step(*data[0])
    torch.manual_seed(4)
    new = nn.Linear(64, 10)
    t.model[2] = new
    t.ref[2] = copy.deepcopy(new)
    t.opt.param_groups[0]["params"][2:4] = list(new.parameters())  # the optimizer follows
    t.ref_opt.param_groups[0]["params"][2:4] = list(t.ref[2].parameters())
    t.step(*data[1])
    t.check()


def test_a_layer_deleted_after_the_first_call_recaptures():
    model = nn.Sequential(nn.Linear(256, 10), nn.ReLU(), nn.Linear(10, 10))
    t = Twin(model, lambda m: torch.optim.SGD(m[0].parameters(), lr=0.1))
    data = _batches()
    t.step(*data[0])
    del t.model[2]
    del t.ref[2]
    t.step(*data[1])
    t.check()


def test_the_graphs_model_reassigned_trains_the_new_model():
    t = _structure_twin()
    data = _batches()
    t.step(*data[0])
    other = seed_mlp()
    other_ref = copy.deepcopy(other)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other_ref_opt = torch.optim.SGD(other_ref.parameters(), lr=0.1)
    t.g.model = other
    t.g._optimizer_slots.clear()  # a new model, a new optimizer (see next test for the API way)
    t.g.add_optimizer(other_opt)
    t.g(*data[1])
    eager_step(other_ref, F.cross_entropy, other_ref_opt, *data[1])
    assert_state_close(other, other_ref)


@pytest.mark.parametrize("frozen", ["0.weight", "2.bias"])
def test_requires_grad_flipped_after_the_first_call_freezes_like_eager(frozen):
    t = _structure_twin()
    data = _batches()
    t.step(*data[0])
    for m in (t.model, t.ref):
        m.get_parameter(frozen).requires_grad_(False)
    t.step(*data[1])
    t.step(*data[2])
    t.check()
    for m in (t.model, t.ref):
        m.get_parameter(frozen).requires_grad_(True)
    t.step(*data[3])
    t.check()


def test_a_parameter_removed_from_a_param_group_stops_training():
    t = _structure_twin()
    data = _batches()
    t.step(*data[0])
    for opt in (t.opt, t.ref_opt):
        opt.param_groups[0]["params"].pop()  # the last bias leaves the optimizer
        opt.state.pop(next(iter([])), None) if False else None
    t.step(*data[1])
    assert_state_close(t.model, t.ref)


def _damped(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.5)


def _join_later(t: Twin, how: str) -> None:
    """The first layer, frozen so far, starts training (on both twins)."""
    for m, opt in ((t.model, t.opt), (t.ref, t.ref_opt)):
        m[0].requires_grad_(True)
        if how == "add_param_group":
            opt.add_param_group({"params": list(m[0].parameters())})


@pytest.mark.parametrize("how", ["add_param_group", "unfreeze"])
def test_sgd_dampened_momentum_of_parameters_that_join_later_starts_from_their_gradient(how):
    """torch starts a parameter's momentum buffer as a copy of its first gradient, whenever
    that comes: a group added with add_param_group, or a frozen layer unfrozen mid-run. The
    other parameters' buffers keep going (dampened)."""
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
    model[0].requires_grad_(False)
    make_opt = (lambda m: _damped(m[2].parameters())) if how == "add_param_group" else None
    t = Twin(model, make_opt or (lambda m: _damped(m.parameters())))
    data = _batches()
    t.step(*data[0])
    t.step(*data[1])
    _join_later(t, how)
    t.step(*data[2])
    t.check()
    t.step(*data[3])
    t.check()


def test_a_skipped_first_step_keeps_a_buffer_unstarted_across_a_checkpoint(tmp_path):
    """With a scaler, the joining layer's first step overflows and is skipped: torch leaves its
    buffer missing, so the next applied step starts it from the gradient. graphamp keeps the
    same per-parameter fact in g.state_dict(): a run resumed from a checkpoint taken right after
    the skipped step goes on like the uninterrupted run and like eager."""
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))
    model[0].requires_grad_(False)
    ref = copy.deepcopy(model)
    opt, ref_opt = _damped(model.parameters()), _damped(ref.parameters())
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    g = make_graph(model, nn.CrossEntropyLoss(), opt, scaler=graphamp.GradScaler(init_scale=256.0))
    data = _batches(4)
    data[2][0][0, 0] = float("inf")  # the first step of the joining layer overflows

    def eager(x, y):
        return autocast_step(lambda: F.cross_entropy(ref(x), y), ref_opt, None, ref_scaler)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp32 with a scaler: "unnecessary"
        for x, y in data[:2]:
            g(x, y)
            eager(x, y)
        ref[0].requires_grad_(True)
        model[0].requires_grad_(True)
        g(*data[2])
        assert eager(*data[2]).skipped and "momentum_buffer" not in ref_opt.state[ref[0].weight]
        path = tmp_path / "ckpt.pt"
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict(), "g": g.state_dict()}, path
        )
        saved = torch.load(path, weights_only=True)
        assert saved["g"]["momentum_fresh"] == {0: [0, 1]}  # the first layer's weight and bias
        resumed_model = copy.deepcopy(model)
        resumed_opt = _damped(resumed_model.parameters())
        resumed = make_graph(
            resumed_model, nn.CrossEntropyLoss(), resumed_opt, scaler=graphamp.GradScaler()
        )
        resumed.load_state_dict(saved["g"])  # before the optimizer's state: either order works
        resumed_model.load_state_dict(saved["model"])
        resumed_opt.load_state_dict(saved["opt"])
        for step in (g, eager, resumed):
            step(*data[3])
    assert_state_close(model, ref)
    assert_optimizer_close(opt, ref_opt)
    assert_state_close(resumed_model, model, rtol=0, atol=0)
    assert_optimizer_close(resumed_opt, opt, rtol=0, atol=0)


@pytest.mark.parametrize(
    "value, message",
    [
        ({5: [0]}, "names optimizer 5"),
        ({0: [99]}, "names parameter 99"),
        ({0: [-1]}, "position of optimizer 0 must be an int >= 0"),
        ([0], "momentum_fresh must be a dict"),
    ],
)
def test_a_loaded_momentum_start_that_names_nothing_is_refused(value, message):
    t = Twin(seed_mlp(), lambda m: _damped(m.parameters()))
    t.step(*_batches(1)[0])
    good = t.g.state_dict()
    with pytest.raises(ConfigError, match=message):
        t.g.load_state_dict({**good, "momentum_fresh": value})
    assert t.g.state_dict()["momentum_fresh"] == good["momentum_fresh"] == {}


# -- 4-6. scalers and loads ------------------------------------------------------------------------


def _no_scaler_run(scaler, amp=torch.bfloat16):
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=amp,
        scaler=scaler,
    )
    x, y = _batches(1)[0]
    x = x.clone()
    x[0, 0] = float("inf")  # would be skipped by an enabled scaler
    g(x, y)
    return g, model


@pytest.mark.parametrize(
    "make",
    [
        lambda: graphamp.GradScaler(enabled=False),
        lambda: torch.amp.GradScaler("cpu", enabled=False),
    ],
    ids=["graphamp", "torch"],
)
def test_a_disabled_scaler_is_no_scaler(make):
    g, model = _no_scaler_run(make())
    assert g.grad_scaler.get_scale() == 1.0 and g.grad_scaler.state_dict() == {}
    history = g.history.fetch()
    assert history["scale"] == [1.0] and history["skipped"] == [0.0]  # nothing scaled or skipped
    assert not torch.isfinite(model[0].weight).all()  # the inf batch was applied, as in torch
    step = g.compiled_steps[-1].step_graph
    assert "grad_scaler" not in {n.meta.get("graphamp_subgraph") for n in step.graph.nodes}


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: graphamp.StaticGradScaler(math.inf), "scale must be a positive number"),
        (
            lambda: graphamp.GradScaler(growth_factor=math.inf),
            "growth_factor must be greater than 1",
        ),
        (lambda: graphamp.GradScaler(init_scale=math.nan), "init_scale must be a positive number"),
        (lambda: graphamp.GradScaler(growth_interval=0), "growth_interval must be a positive int"),
        (lambda: graphamp.GradScaler(backoff_factor=math.nan), "backoff_factor must be in"),
    ],
)
def test_non_finite_or_out_of_range_scaler_settings_raise(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("scale", math.nan, "loaded scale"),
        ("scale", -2.0, "loaded scale"),
        ("scale", math.inf, "loaded scale"),
        ("_growth_tracker", -1, "_growth_tracker"),
        ("growth_factor", 0.5, "growth_factor"),
        ("growth_interval", 0, "growth_interval"),
        ("scale", 2.0**30, r"outside \[min_scale, max_scale\]"),  # as init_scale is checked
        ("min_scale", 1024.0, r"outside \[min_scale, max_scale\]"),
        ("scale", 0.0, "loaded scale must be a positive number"),  # min_scale is 1
        ("_hysteresis_tracker", 2, "greater than its hysteresis"),
        ("hysteresis", 0, "hysteresis must be a positive int"),
        ("max_scale", math.nan, "max_scale"),
    ],
)
def test_invalid_loaded_scaler_states_raise_and_change_nothing(key, value, message):
    scaler = graphamp.GradScaler(init_scale=512.0, growth_interval=7)
    good = scaler.state_dict()
    with pytest.raises(ConfigError, match=message):
        scaler.load_state_dict({**good, key: value})
    assert scaler.state_dict() == good


def test_static_and_dynamic_scaler_states_convert_with_their_documented_meaning():
    static = graphamp.StaticGradScaler(128.0)
    dynamic = graphamp.GradScaler(init_scale=4.0, growth_interval=50, growth_factor=3.0)
    dynamic.load_state_dict(static.state_dict())  # the scale only; the schedule stays
    assert dynamic.get_scale() == 128.0
    assert (dynamic.growth_interval, dynamic.growth_factor) == (50, 3.0)
    other = graphamp.StaticGradScaler(2.0)
    other.load_state_dict(dynamic.state_dict())  # a static scaler takes the scale only
    assert other.get_scale() == 128.0 and other.growth_interval == 1
    assert "128.0" in repr(other) and "scale=128.0" in repr(dynamic)


def test_graph_load_state_dict_checks_everything_before_changing_anything():
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        scaler=graphamp.GradScaler(init_scale=256.0),
    )
    with pytest.warns(UserWarning, match="unnecessary"):
        for x, y in _batches(2):
            g(x, y)
    good = g.state_dict()
    bad = {
        **good,
        "grad_scaler": {**good["grad_scaler"], "scale": 1024.0},
        "step": 99,
        "history": {"step": 5, "table": torch.zeros(3, 2)},
    }  # wrong columns
    with pytest.raises(ConfigError, match="history's table"):
        g.load_state_dict(bad)
    after = g.state_dict()
    assert after["step"] == good["step"] == 2 and after["grad_scaler"] == good["grad_scaler"]
    torch.testing.assert_close(after["history"]["table"], good["history"]["table"], equal_nan=True)


def test_loading_an_early_state_replaces_every_field_of_a_used_graph():
    """Issue 36: a state saved before any optimizer step (``optimizer_steps == {}``) loaded into
    a used Graph kept the used Graph's step counts. Loaded, it must leave the Graph as a fresh
    Graph given the same state: the same state dict after the same calls."""

    def graph():
        torch.manual_seed(0)
        model = seed_mlp()
        g = make_graph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
        return g, model

    early, _ = graph()
    saved = early.state_dict()
    assert saved["optimizer_steps"] == {}
    used, used_model = graph()
    for x, y in _batches(3):
        used(x, y)
    fresh, fresh_model = graph()
    for g in (used, fresh):
        g.load_state_dict(saved)
    used_model.load_state_dict(fresh_model.state_dict())
    for x, y in _batches(2):
        used(x, y)
        fresh(x, y)
    a, b = used.state_dict(), fresh.state_dict()
    assert a["optimizer_steps"] == b["optimizer_steps"] == {0: 2}
    assert a["step"] == b["step"]
    torch.testing.assert_close(a["history"]["table"], b["history"]["table"], equal_nan=True)


# -- 7. inputs ------------------------------------------------------------------------------------


def test_an_input_that_requires_grad_works_from_the_first_call():
    t = Twin(seed_mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    x, y = _batches(1)[0]
    t.step(x.clone().requires_grad_(True), y)
    t.check()


def test_a_python_number_that_changes_every_call_warns_once_and_names_it():
    """A float that only feeds arithmetic (a temperature) becomes a step input at its first
    change: two compiles, no warning. A number build() needs as a Python number (here a
    branch) compiles per value and is named, once, in the warning."""
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Tempered(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_backend("aot_eager")

        def build(self, x, y, temperature, cap):
            logits = self.model(x) / temperature
            if cap > 2.0:
                logits = logits.clamp(-cap, cap)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            return loss

    g = Tempered()
    x, y = _batches(1)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in (1.0, 1.5, 2.0, 2.5, 3.0, 3.5):
            g(x, y, t, 10.0)
        assert len(g.compiled_steps) == 2
        for cap in (1.0, 1.5, 2.5, 3.0, 3.5):
            g(x, y, 1.0, cap)
        built = len(g.compiled_steps)
        g(x, y, 1.7, 10.0)  # the temperature is still an input
        assert len(g.compiled_steps) == built
    messages = [str(w.message) for w in caught if "baked into the graph" in str(w.message)]
    assert len(messages) == 1 and "cap" in messages[0] and "torch.tensor" in messages[0]


# -- 8. threads -----------------------------------------------------------------------------------


def test_two_threads_calling_a_cold_graph_capture_once_and_both_train():
    t = Twin(seed_mlp(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    x, y = _batches(1)[0]
    results, errors = [], []

    def call():
        try:
            results.append(t.g(x, y))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(results) == 2
    assert len(t.g.compiled_steps) == 1 and t.g.compiled_steps[0].calls == 2
    for _ in range(2):
        eager_step(t.ref, F.cross_entropy, t.ref_opt, x, y)
    t.check()
    assert not torch.compiler.is_compiling()


_THREAD_AMPS = [None, torch.bfloat16, torch.float16]


def _seeded_mlps() -> list[nn.Module]:
    # made in the calling thread: torch's global generator is one per process, so seeding it
    # inside the threads would race
    out = []
    for k in range(len(_THREAD_AMPS)):
        torch.manual_seed(k)
        out.append(seed_mlp())
    return out


def _train_two_steps(k: int, model: nn.Module) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp = _THREAD_AMPS[k]
    scaler = graphamp.GradScaler(init_scale=256.0) if amp == torch.float16 else None
    g = make_graph(model, nn.CrossEntropyLoss(), opt, amp=amp, scaler=scaler)
    for x, y in _batches(2):
        g(x, y)
    return {n: v.clone() for n, v in model.state_dict().items()}


def test_graphs_compiling_at_once_in_several_threads_train_as_when_built_alone():
    """torch's tracing keeps process-wide state and capture installs process-wide hooks: builds
    in different threads take turns, so three Graphs (fp32, bf16, fp16 AMP) started at once all
    train exactly as each does when built alone."""
    alone = [_train_two_steps(k, m) for k, m in enumerate(_seeded_mlps())]
    fresh = _seeded_mlps()
    together: dict[int, dict] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def run(k: int) -> None:
        try:
            start.wait()
            together[k] = _train_two_steps(k, fresh[k])
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for k in range(3):
        for n, v in alone[k].items():
            assert torch.equal(together[k][n], v), (k, n)


# -- 9-10. clear errors instead of internal ones, and calls that do nothing in a graph -------------


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_uint8_class_labels_train_as_in_eager(amp):
    """eager's losses take class indices as int64 or uint8; capture's decompositions (a gather)
    take int64 only: uint8 labels train like eager's, in nn.CrossEntropyLoss and F.nll_loss."""

    def build(self, x, y):
        logits = self.model(x)
        loss = nn.CrossEntropyLoss()(logits, y) + F.nll_loss(logits.log_softmax(-1), target=y)
        loss.backward()
        return loss

    model = seed_mlp()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    g = make_graph(model, None, opt, amp=amp, build=build)
    for x, y in _batches(2):
        y = y.to(torch.uint8)
        loss = g(x, y)
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            logits = ref(x)
            ref_loss = F.cross_entropy(logits, y) + F.nll_loss(logits.log_softmax(-1), y)
        ref_loss.backward()
        ref_opt.step()
        tol = {} if amp is None else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(loss, ref_loss.float().detach(), **tol)
    assert_state_close(model, ref, **({} if amp is None else {"rtol": 2e-2, "atol": 2e-2}))


def test_a_module_used_in_build_but_not_registered_is_named():
    model, other = seed_mlp(), nn.Linear(10, 10)

    def build(self, x, y):
        loss = F.cross_entropy(other(self.model(x)), y)  # the line the error must name
        loss.backward()
        return loss

    g = make_graph(model, None, torch.optim.SGD(model.parameters(), lr=0.1), build=build)
    with pytest.raises(
        CaptureError,
        match=r"calls a Linear that is not registered.*"
        r"test_changes\.py:\d+.*other\(self\.model",
    ):
        g(*_batches(1)[0])


def test_a_plain_tensor_attribute_changed_in_forward_is_named():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 10)
            self.calls = torch.zeros(())

        def forward(self, x):
            self.calls += 1
            return self.fc(x)

    model = Counting()
    g = make_graph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(CaptureError, match=r"'model\.calls' \(a plain attribute.*register_buffer"):
        g(*_batches(1)[0])
    assert model.calls.item() == 0  # nothing happened to it at capture


CALLS_IN_BUILD = {
    "step": (lambda self, opt: opt.step(), r"torch\.optim.*remove optimizer"),
    "torch scaler.scale": (
        lambda self, opt: torch.amp.GradScaler("cpu").scale(torch.ones(())),
        r"GradScaler.*set_grad_scaler",
    ),
    "torch scaler.step": (
        lambda self, opt: torch.amp.GradScaler("cpu").step(opt),
        r"GradScaler.*set_grad_scaler",
    ),
}


@pytest.mark.parametrize("name", sorted(CALLS_IN_BUILD))
def test_calls_that_would_do_nothing_in_a_graph_are_refused_with_the_fix(name):
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_step(
        model, F.cross_entropy, opt, *_batches(1)[0]
    )  # stale .grad everywhere: must not be stepped in
    before = snapshot(model, opt)
    call, message = CALLS_IN_BUILD[name]

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        call(self, opt)
        return loss

    g = make_graph(model, None, opt, build=build)
    with pytest.raises(CaptureError, match=message):
        g(*_batches(1)[0])
    assert_unchanged(before, model, opt)


def test_an_eval_graph_with_fp16_amp_does_not_warn_about_a_scaler():
    model = seed_mlp()

    class Eval(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.config.enable_amp(True)
            self.config.set_backend("aot_eager")

        def build(self, x):
            return self.model(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Eval()(_batches(1)[0][0])


class DeclaresFp32(nn.Module):
    """A model that declares fp32 parts the way transformers models do."""

    _keep_in_fp32_modules_strict = ["head"]  # matched as a pattern, as transformers does

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.body(x).relu())


def _head_mm_dtypes(g):
    return [
        r["dtype"]
        for r in g.precision_report(with_autocast=False).rows
        if r["module"] == "model.head" and r["op"] in ("aten.mm", "aten.addmm")
    ]


def test_a_models_declared_fp32_parts_are_pinned_and_unpinning_is_seen():
    model = DeclaresFp32()
    g = make_graph(
        model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), amp=torch.bfloat16
    )
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    g(x, y)
    assert _head_mm_dtypes(g) == ["float32"]
    why = {
        r["why"]
        for r in g.precision_report(with_autocast=False).rows
        if r["module"] == "model.head" and r["op"] != "aten._to_copy"
    }
    assert (
        "inside fp32-pinned module model.head: pinned fp32 by the model's "
        "_keep_in_fp32_modules_strict ('head')" in why
    )
    model._keep_in_fp32_modules_strict = None  # the user's opt-out, after the first call
    g(x, y)
    assert _head_mm_dtypes(g) == ["bfloat16"]
    assert len(g.compiled_steps) == 2
