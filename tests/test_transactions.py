"""A step is a transaction. Ctrl-C or an error at any moment of a call leaves the
training state from before the step or from after it, never between."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import warnings

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphamp

# the interrupts these tests send must raise, however pytest was started (conftest.py)
pytestmark = pytest.mark.usefixtures("sigint_raises")


def _mlp(layers: int = 7, width: int = 64) -> nn.Module:
    return models.mlp(*[width] * layers, 8, act=nn.GELU)


class Train(graphamp.Graph):
    def __init__(self, model, opt, sch, backend):
        super().__init__()
        self.model = model
        self.add_optimizer(opt, lr_sch=sch)
        self.config.enable_amp(True)
        self.config.set_backend(backend)
        self.set_grad_scaler(graphamp.GradScaler(init_scale=2.0**8))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _setup(backend: str, lambda_fn=None):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda_fn or (lambda s: 1.0 / (1 + 0.01 * s)))
    return model, opt, sch, Train(model, opt, sch, backend)


def _state(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for s in opt.state.values():
        out += [v.detach().clone() for v in s.values()]
    return out


def _consistent(g, model, opt, sch, before, steps_before) -> str | None:
    """None if the state is wholly from before the last call or wholly from after it."""
    steps = g.step_count
    if steps not in (steps_before, steps_before + 1):
        return f"graph step {steps} after {steps_before}"
    adam = {float(s["step"]) for s in opt.state.values()}
    skipped = int(sum(g.history.fetch()["skipped"])) if steps else 0
    if sch.last_epoch != steps or (steps and adam != {float(steps - skipped)}):
        return f"graph {steps}, scheduler {sch.last_epoch}, adam {sorted(adam)}"
    params = [p.detach() for p in model.parameters()]
    same = [torch.equal(a, b) for a, b in zip(before, params)]
    if steps == steps_before and not all(same):
        return "a step that did not count changed parameters"
    if steps == steps_before + 1 and any(same) and not g.grad_scaler.found_inf.item():
        return "a step that counted left some parameters unchanged"
    if opt.param_groups[0]["lr"] != sch.get_last_lr()[0]:
        return "the optimizer's lr and the scheduler disagree"
    return None


def _retry(fn):
    """Run fn to completion even if a late Ctrl-C from the hunter lands in it."""
    while True:
        try:
            return fn()
        except KeyboardInterrupt:
            continue


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("aot_eager", marks=pytest.mark.slow),  # 20 s
        pytest.param("inductor", marks=[pytest.mark.inductor, pytest.mark.slow]),
    ],
)
def test_real_interrupts_at_random_moments_never_tear_the_state(backend):
    """A timer thread sends SIGINT at a random offset of ~500 calls (the first, compiling, call
    included); after each call the counters of the graph, of Adam's every parameter and of the
    scheduler agree, and parameters are the before or the after values of that step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, sch, g = _setup(backend)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(32, 64, generator=gen), torch.randint(0, 8, (32,), generator=gen))
        for _ in range(8)
    ]
    rng = random.Random(0)
    armed = threading.Event()
    durations, interrupted = [2e-3], 0

    def hunt(delay: float):
        time.sleep(delay)
        if armed.is_set():
            os.kill(os.getpid(), signal.SIGINT)

    def one_call(i: int) -> None:
        g(*batches[i % len(batches)])

    t0 = time.perf_counter()
    one_call(0)  # compile outside the hunt: interrupts during capture are tested separately
    compile_s = time.perf_counter() - t0
    for i in range(1, 501):
        before = _retry(lambda: _state(model, opt))
        steps_before = g.step_count
        hunter = threading.Thread(target=hunt, args=(rng.uniform(0, 1.5) * max(durations),))
        start = time.perf_counter()
        try:
            armed.set()
            hunter.start()
            one_call(i)
            durations.append(time.perf_counter() - start)
            durations = durations[-20:]
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            armed.clear()
        _retry(hunter.join)
        problem = _retry(lambda: _consistent(g, model, opt, sch, before, steps_before))
        assert problem is None, f"call {i}: {problem}"
    assert interrupted > 15, interrupted  # the hunt really interrupted calls
    assert g.step_count > 100, (g.step_count, compile_s)  # and most calls still trained


def test_a_scheduler_that_raises_leaves_everything_from_before_the_step():
    calls = {"n": 0}

    def flaky(step):
        calls["n"] += 1
        if step == 3 and calls["n"] < 10:
            raise ZeroDivisionError("the user's schedule broke")
        return 1.0 / (1 + step)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, sch, g = _setup("aot_eager", flaky)
    x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
    for _ in range(2):
        g(x, y)
    before, lr_before, epoch_before = _state(model, opt), opt.param_groups[0]["lr"], sch.last_epoch
    with pytest.raises(ZeroDivisionError):
        g(x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, opt)))
    assert (g.step_count, sch.last_epoch, opt.param_groups[0]["lr"]) == (2, epoch_before, lr_before)
    calls["n"] = 100  # the schedule is fixed: training goes on from where it was
    g(x, y)
    assert _consistent(g, model, opt, sch, before, 2) is None


def test_an_error_inside_the_step_leaves_everything_from_before(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, sch, g = _setup("aot_eager")
    x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
    g(x, y)
    before = _state(model, opt)
    runner = g._programs[next(iter(g._programs))].runner  # inject a failure

    def failing(*flat):
        raise RuntimeError("injected failure in the compiled step")

    monkeypatch.setattr(runner, "compiled", failing)
    with pytest.raises(RuntimeError, match="injected"):
        g(x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, opt)))
    assert g.step_count == sch.last_epoch == 1 and runner.calls == 1


def test_a_graph_called_from_another_thread_keeps_working():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, sch, g = _setup("aot_eager")
    x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
    errors = []

    def train():
        try:
            for _ in range(5):
                g(x, y)
        except Exception as e:  # reported below
            errors.append(e)

    worker = threading.Thread(target=train)
    worker.start()
    worker.join()
    assert not errors and g.step_count == sch.last_epoch == 5
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler or callable(
        signal.getsignal(signal.SIGINT)
    )


@pytest.mark.parametrize("before", ["ignored", "a handler"])
def test_a_ctrl_c_during_a_step_goes_once_to_the_handler_set_before_graphamps(before, monkeypatch):
    """``nohup`` and ``&`` start Python with SIGINT ignored; a program may install its own
    handler. graphamp's handler goes in front at the first step, holds a Ctrl-C that arrives
    while a step commits, and then hands it to that handler once, after the step: ignored stays
    ignored, and a handler runs once per signal and sees the step done."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, sch, g = _setup("aot_eager")
    seen: list[int] = []
    theirs = signal.SIG_IGN if before == "ignored" else (lambda s, f: seen.append(g.step_count))
    signal.signal(signal.SIGINT, theirs)
    x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
    g(x, y)
    assert signal.getsignal(signal.SIGINT) is not theirs  # graphamp's now receives the signal
    runner = g._programs[next(iter(g._programs))].runner  # interrupt inside it
    compiled = runner.compiled

    def interrupted(*flat):
        os.kill(os.getpid(), signal.SIGINT)  # lands while the step commits
        return compiled(*flat)

    monkeypatch.setattr(runner, "compiled", interrupted)
    before_state = _state(model, opt)
    g(x, y)
    g(x, y)
    assert g.step_count == sch.last_epoch == 3
    assert not any(torch.equal(a, b) for a, b in zip(before_state, _state(model, opt)))
    assert seen == ([] if before == "ignored" else [2, 3])


@pytest.mark.slow
def test_ctrl_c_during_the_first_call_leaves_the_model_as_it_was():
    """Interrupts land at spread-out moments of capture, AMP passes and compile: every time the
    model still holds its own real tensors, nothing trained, and the next call works."""
    from torch._subclasses.fake_tensor import FakeTensor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, sch, g = _setup("aot_eager")
    x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
    before = _state(model, opt)
    ids = [id(p) for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe_model, probe_opt, probe_sch, _ = _setup("aot_eager")
    for _ in range(2):  # the second first call is the one to time: torch's caches are warm
        start = time.perf_counter()
        Train(probe_model, probe_opt, probe_sch, "aot_eager")(x, y)
        first_call = time.perf_counter() - start
    interrupted = completed = 0
    for k in range(8):
        fresh = Train(model, opt, sch, "aot_eager")
        timer = threading.Timer(first_call * k / 8, lambda: os.kill(os.getpid(), signal.SIGINT))
        try:
            timer.start()
            fresh(x, y)
        except KeyboardInterrupt:
            interrupted += 1
        _retry(timer.join)  # the interrupt may come after the call: wait it out
        if fresh.step_count:  # the call finished: its step is the new "before"
            completed += 1
            before = _retry(lambda: _state(model, opt))
        assert [id(p) for p in model.parameters()] == ids
        assert not any(isinstance(t, FakeTensor) for t in _state(model, opt))
        assert all(torch.equal(a, b) for a, b in zip(before, _state(model, opt)))
        assert sch.last_epoch == completed
    assert interrupted >= 3, (interrupted, completed)
    g(x, y)  # a Graph that was never interrupted trains on from there
    assert g.step_count == 1 and sch.last_epoch == completed + 1


def test_an_interrupt_that_leaves_torchs_dispatch_state_half_set_is_put_right(monkeypatch, caplog):
    """A Ctrl-C landing inside one of torch's context managers during a build once left the
    Python dispatcher's key included without its state, and every later tensor op of the
    process raised an internal assert: the call puts torch's dispatch state back as it was
    at its entry, says so, and the process and the Graph go on working."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphamp.pipeline import stages

    model, opt, sch, g = _setup("aot_eager")
    x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
    before = _state(model, opt)
    plan = stages.plan

    def interrupted_half_way(*args, **kwargs):
        FakeTensorMode().__enter__()  # entered, never left
        torch._C._dispatch_tls_set_dispatch_key_included(
            torch._C.DispatchKey.PythonDispatcher, True
        )
        raise KeyboardInterrupt

    monkeypatch.setattr(stages, "plan", interrupted_half_way)
    with pytest.raises(KeyboardInterrupt), caplog.at_level("WARNING", logger="graphamp"):
        g(x, y)
    assert "PythonDispatcher not included" in caplog.text and "fake mode unset" in caplog.text
    assert not torch._C._dispatch_tls_is_dispatch_key_included(
        torch._C.DispatchKey.PythonDispatcher
    )
    assert all(torch.equal(a, b.clone()) for a, b in zip(before, _state(model, opt)))
    monkeypatch.setattr(stages, "plan", plan)
    g(x, y)
    assert g.step_count == 1 and sch.last_epoch == 1
