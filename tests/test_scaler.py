"""The grad-scaler subgraph against eager torch.amp.GradScaler."""

from __future__ import annotations

import copy
import math
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import models
import pytest
import torch
import torch.nn as nn
from helpers import assert_optimizer_close, assert_state_close, autocast_step, make_graph
from models import SmallCNN, seed_mlp

import graphamp
from graphamp import ConfigError
from graphamp.runtime.torch_scaler import TakenOverGradScaler

# Many tests run the scaler on fp32 steps, where its trajectory must equal torch's exactly (no
# fp16 rounding decides which steps overflow); graphamp rightly warns that this is unneeded.
pytestmark = pytest.mark.filterwarnings("ignore:.*loss scaling is unnecessary")

INF_STEPS = {3, 4, 11, 20, 21, 22, 37, 50}


def _batches(n=60, poison=INF_STEPS, shape=(32, 256), classes=10):
    out = models.batches(n, shape[0], shape[1:], classes, seed=3)
    for step, (x, _) in enumerate(out):
        if step in poison:
            x[0, 0] = float("inf")
    return out


def _eager_run(model, opt, scaler, batches, clip=None, norm_type=2.0):
    """The documented eager recipe: scale, backward, unscale_, (clip), step, update."""
    steps = [
        autocast_step(
            lambda: nn.functional.cross_entropy(model(x), y),
            opt,
            None,
            scaler,
            clip=clip,
            norm_type=norm_type,
        )
        for x, y in batches
    ]
    return [s.scale for s in steps], [s.norm for s in steps if s.norm is not None]


_quiet_graph = make_graph


SETTINGS = {
    "default": {},
    "custom": {
        "init_scale": 1024.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.3,
        "growth_interval": 5,
    },
}


@pytest.mark.parametrize("take_over", [False, True], ids=["graphamp_scaler", "torch_scaler"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_scale_trajectory_and_parameters_equal_eager_gradscaler(setting, take_over):
    kwargs = SETTINGS[setting]
    model = seed_mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ref_scaler = torch.amp.GradScaler("cpu", **kwargs)
    if take_over:
        scaler = torch.amp.GradScaler("cpu", **kwargs)
    else:  # graphamp's scaler with torch's semantics: no floor, no cap
        scaler = graphamp.GradScaler(**kwargs, min_scale=0.0, max_scale=math.inf)
    g = _quiet_graph(model, nn.CrossEntropyLoss(), opt, scaler=scaler)
    batches = _batches()
    for x, y in batches:
        g(x, y)
    ref_scales, _ = _eager_run(ref, ref_opt, ref_scaler, batches)
    history = g.history.fetch()
    assert history["scale"] == ref_scales  # exactly, step by step
    assert [s for s, k in enumerate(history["skipped"]) if k] == sorted(INF_STEPS)
    assert g.grad_scaler.get_scale() == ref_scaler.get_scale()
    assert (
        g.grad_scaler.state_dict()["_growth_tracker"] == ref_scaler.state_dict()["_growth_tracker"]
    )
    assert_state_close(model, ref)
    assert_optimizer_close(opt, ref_opt)


def test_fp16_trajectory_with_injected_overflows():
    model = seed_mlp()
    ref = copy.deepcopy(model)
    kwargs = {"init_scale": 64.0, "growth_interval": 7}
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.01),
        amp=torch.float16,
        scaler=graphamp.GradScaler(**kwargs),
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    ref_scaler = torch.amp.GradScaler("cpu", **kwargs)
    batches = _batches(40)
    for x, y in batches:
        g(x, y)
    scales = [
        autocast_step(
            lambda: nn.functional.cross_entropy(ref(x), y), ref_opt, torch.float16, ref_scaler
        ).scale
        for x, y in batches
    ]
    assert g.history.fetch()["scale"] == scales
    assert_state_close(model, ref, rtol=2e-2, atol=2e-3)


def _full_state(model, opt):
    state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            state[f"opt.{i}.{k}"] = torch.as_tensor(v).clone()
    return state


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
        lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
    ],
    ids=["sgd_momentum", "adam", "adamw"],
)
def test_skipped_step_leaves_every_state_tensor_bitwise_unchanged(make_opt):
    model = SmallCNN()
    opt = make_opt(model.parameters())
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        opt,
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=256.0),
    )
    batches = _batches(3, poison={2}, shape=(4, 3, 16, 16))
    for x, y in batches[:2]:
        g(x, y)
    before = _full_state(model, opt)
    scale_before = g.grad_scaler.get_scale()
    g(*batches[2])
    after = _full_state(model, opt)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed on a skipped step"
    assert g.grad_scaler.get_scale() == scale_before / 2
    assert g.grad_scaler.found_inf.item() == 1.0
    assert model.features[1].num_batches_tracked.item() == 2  # BN statistics masked too
    g(*batches[0])
    assert g.grad_scaler.found_inf.item() == 0.0


def test_scale_stays_within_min_and_max():
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.01),
        amp=torch.float16,
        scaler=graphamp.GradScaler(
            init_scale=8.0, min_scale=0.5, max_scale=64.0, growth_interval=1
        ),
    )
    for x, y in _batches(10, poison=set(range(10))):
        g(x, y)
    assert g.grad_scaler.get_scale() == 0.5  # 8 -> 4 -> 2 -> 1 -> 0.5, then held at the floor
    for x, y in _batches(10, poison=set()):
        g(x, y)
    assert g.grad_scaler.get_scale() == 64.0  # grows every clean step, capped at max_scale
    scales = g.history.fetch()["scale"]
    assert min(scales) == 0.5 and max(scales) == 64.0


def test_a_hundred_consecutive_overflows_neither_crash_nor_poison_the_model():
    model = seed_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = make_graph(
        model, nn.CrossEntropyLoss(), opt, amp=torch.float16, scaler=graphamp.GradScaler()
    )
    clean = _batches(1, poison=set())[0]
    g(*clean)
    before = _full_state(model, opt)
    for x, y in _batches(100, poison=set(range(100))):
        g(x, y)
    after = _full_state(model, opt)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert g.grad_scaler.get_scale() == 1.0  # the default floor, not 2**16 * 0.5**100
    assert sum(g.history.fetch()["skipped"]) == 100
    g(*clean)  # and training goes on
    assert g.grad_scaler.found_inf.item() == 0.0


def test_a_scale_collapsed_to_zero_skips_instead_of_writing_nan():
    """With torch's bounds (min_scale=0) a run of overflows drives the scale below 2**-128,
    whose reciprocal is inf in fp32: finite scaled gradients would unscale to inf/NaN and pass
    torch's check (found by the 10,000-step soak). graphamp counts it as an overflow."""
    model = seed_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        opt,
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=2.0**-127, min_scale=0.0),
    )
    before = _full_state(model, opt)
    for x, y in _batches(3, poison={0}):
        g(x, y)  # a real overflow halves the scale to 2**-128, whose reciprocal overflows
    assert g.history.fetch()["skipped"] == [1.0, 1.0, 1.0]
    after = _full_state(model, opt)
    assert all(torch.equal(before[k], after[k]) for k in before)  # no NaN written, no change


def test_hysteresis_tolerates_isolated_overflows():
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.01),
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=128.0, hysteresis=2),
    )
    batches = _batches(4, poison={1, 2})
    scales = []
    for x, y in batches:
        g(x, y)
        scales.append(g.grad_scaler.get_scale())
    # first overflow: skipped, scale kept; second: backs off; steps skipped both times
    assert scales == [128.0, 128.0, 64.0, 64.0]
    assert g.history.fetch()["skipped"] == [0.0, 1.0, 1.0, 0.0]


def test_static_scaler_keeps_its_scale_and_still_skips():
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.01),
        amp=torch.float16,
        scaler=graphamp.StaticGradScaler(512.0),
    )
    for x, y in _batches(5, poison={2}):
        g(x, y)
    history = g.history.fetch()
    assert set(history["scale"]) == {512.0} and history["skipped"][2] == 1.0


@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
def test_clipping_after_unscale_matches_clip_grad_norm(norm_type):
    model = seed_mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = graphamp.GradScaler(init_scale=1024.0, min_scale=0.0, max_scale=math.inf)

    class G(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt, clip_grad_max_norm=0.05, clip_grad_norm_type=norm_type)
            self.set_grad_scaler(scaler)
            self.config.set_backend("aot_eager")

        def build(self, x, y):
            loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = G()
    batches = _batches(8, poison={5})
    for x, y in batches:
        g(x, y)
    _, ref_norms = _eager_run(
        ref,
        ref_opt,
        torch.amp.GradScaler("cpu", init_scale=1024.0),
        batches,
        clip=0.05,
        norm_type=norm_type,
    )
    norms = g.history.fetch()["grad_norm"]
    for i, (a, b) in enumerate(zip(norms, ref_norms)):
        if i == 5:
            assert not math.isfinite(a) and not math.isfinite(b)
        else:
            assert a == pytest.approx(b, rel=1e-5)
    assert_state_close(model, ref)


def test_a_non_finite_norm_counts_as_an_overflow_even_without_inf_gradients():
    # huge but finite gradients: the L2 norm overflows fp32 while no gradient is inf
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, y):
        loss = (self.model(x) * 1e30).pow(2).mean() * 1e-30
        loss.backward()
        return loss

    g = _quiet_graph(
        model,
        None,
        opt,
        build=build,
        clip=1.0,
        scaler=graphamp.GradScaler(init_scale=1.0, min_scale=0.0),
    )
    before = [p.detach().clone() for p in model.parameters()]
    g(torch.full((2, 4), 1e4), None)
    assert g.history.fetch()["skipped"] == [1.0]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_two_optimizers_skip_independently_like_eager():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 2)
            self.b = nn.Linear(8, 2)

    def run(graph_mode):
        torch.manual_seed(0)
        m = TwoHeads()
        oa = torch.optim.SGD(m.a.parameters(), lr=0.1)
        ob = torch.optim.SGD(m.b.parameters(), lr=0.1)
        xa, xb = torch.randn(4, 8), torch.randn(4, 8)
        xb[0, 0] = float("inf")  # only head b overflows
        y = torch.randint(0, 2, (4,))
        if graph_mode:

            class G(graphamp.Graph):
                def __init__(self):
                    super().__init__()
                    self.m = m
                    self.add_optimizer(oa)
                    self.add_optimizer(ob)
                    self.set_grad_scaler(graphamp.GradScaler(init_scale=16.0))
                    self.config.set_backend("aot_eager")

                def build(self, xa, xb, y):
                    loss = nn.functional.cross_entropy(
                        self.m.a(xa), y
                    ) + nn.functional.cross_entropy(self.m.b(xb), y)
                    loss.backward()
                    return loss

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                g = G()
            g(xa, xb, y)
            return m, g.grad_scaler.get_scale()
        scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
        loss = nn.functional.cross_entropy(m.a(xa), y) + nn.functional.cross_entropy(m.b(xb), y)
        scaler.scale(loss).backward()
        scaler.step(oa)
        scaler.step(ob)
        scaler.update()
        return m, scaler.get_scale()

    (ours, our_scale), (ref, ref_scale) = run(True), run(False)
    fresh = TwoHeads()
    torch.manual_seed(0)
    fresh = TwoHeads()
    assert not torch.equal(ours.a.weight, fresh.a.weight)  # a stepped
    assert torch.equal(ours.b.weight, fresh.b.weight)  # b skipped
    assert_state_close(ours, ref)
    assert our_scale == ref_scale == 8.0


# -- state dicts and checkpoints ----------------------------------------------------------------


def test_state_dict_keys_and_meaning_match_torch_both_ways():
    ours = graphamp.GradScaler(init_scale=1024.0, growth_interval=7)
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    a, b = ours.state_dict(), theirs.state_dict()
    assert set(b) <= set(a)
    assert all(a[k] == b[k] for k in b)
    theirs.load_state_dict(dict(a, scale=256.0, _growth_tracker=3))
    assert theirs.get_scale() == 256.0 and theirs._get_growth_tracker() == 3
    ours.load_state_dict(dict(b, scale=32.0))
    assert ours.get_scale() == 32.0


def test_set_grad_scaler_takes_over_a_torch_scaler_with_its_state():
    theirs = torch.amp.GradScaler(
        "cpu", init_scale=4096.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=9
    )
    theirs.load_state_dict(dict(theirs.state_dict(), scale=100.0, _growth_tracker=4))
    model = seed_mlp()
    g = _quiet_graph(
        model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1), scaler=theirs
    )
    s = g.grad_scaler
    assert isinstance(s, graphamp.GradScaler)
    assert (s.get_scale(), s.growth_factor, s.backoff_factor, s.growth_interval) == (
        100.0,
        3.0,
        0.25,
        9,
    )
    assert s.state_dict()["_growth_tracker"] == 4 and s.min_scale == 0.0


def test_a_taken_over_torch_scaler_stays_the_truth():
    """The user's torch scaler, already used eagerly, then handed over: what they load into it
    before the first call is used, and after each call it holds the graph's state (its tensors
    are the ones the step writes), as does a pickled copy of the graph's scaler."""
    model = seed_mlp()
    theirs = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=2)
    theirs.scale(torch.ones(()))  # eager use: its scale tensor exists
    g = _quiet_graph(
        model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1), scaler=theirs
    )
    theirs.load_state_dict(dict(theirs.state_dict(), scale=1024.0, _growth_tracker=1))
    batches = _batches(5, poison={3})
    for x, y in batches:
        g(x, y)
    # 1024 grows at once (tracker 1 of 2), again 2 clean steps later, then backs off
    assert g.history.fetch()["scale"] == [1024.0, 2048.0, 2048.0, 4096.0, 2048.0]
    assert theirs.get_scale() == g.grad_scaler.get_scale() == 2048.0
    assert theirs.state_dict()["_growth_tracker"] == 1
    copy_ = pickle.loads(pickle.dumps(g.grad_scaler))
    assert copy_.state_dict() == g.grad_scaler.state_dict()


def test_graph_state_dict_loads_with_weights_only(tmp_path):
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.Adam(model.parameters()),
        amp=torch.float16,
        scaler=graphamp.GradScaler(),
    )
    for x, y in _batches(3, poison={1}):
        g(x, y)
    path = tmp_path / "graph.pt"
    torch.save(g.state_dict(), path)
    state = torch.load(path, weights_only=True)
    assert state["step"] == 3 and state["grad_scaler"]["scale"] == 2.0**15
    assert state["history"]["table"].shape[1] == 5


RESUME_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.nn as nn, graphamp
    sys.path.insert(0, {tests!r})
    from models import SmallCNN
    phase, path, total = sys.argv[1], sys.argv[2], 12
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)

    class G(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.loss_fn = nn.CrossEntropyLoss()
            self.add_optimizer(opt, lr_sch=sch, clip_grad_max_norm=1.0)
            self.config.enable_amp(True)
            self.config.set_backend("aot_eager")
            self.set_grad_scaler(graphamp.GradScaler(init_scale=2.0 ** 10, growth_interval=3))

        def build(self, x, y):
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss

    g = G()
    gen = torch.Generator().manual_seed(5)
    data = []
    for step in range(total):
        x = torch.randn(4, 3, 16, 16, generator=gen)
        if step in (2, 7):
            x[0, 0, 0, 0] = float("inf")
        data.append((x, torch.randint(0, 10, (4,), generator=gen)))
    if phase == "first":
        for x, y in data[:6]:
            g(x, y)
        torch.save({{"model": model.state_dict(), "opt": opt.state_dict(),
                    "sch": sch.state_dict(), "graph": g.state_dict()}}, path)
    elif phase == "second":
        ckpt = torch.load(path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sch.load_state_dict(ckpt["sch"])
        g.load_state_dict(ckpt["graph"])
        for x, y in data[6:]:
            g(x, y)
        torch.save({{"model": model.state_dict(), "opt": opt.state_dict(),
                    "graph": g.state_dict()}}, path)
    else:
        for x, y in data:
            g(x, y)
        torch.save({{"model": model.state_dict(), "opt": opt.state_dict(),
                    "graph": g.state_dict()}}, path)
""")


@pytest.mark.slow
def test_resume_in_a_fresh_process_is_bitwise_identical(tmp_path):
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    split, whole = tmp_path / "split.pt", tmp_path / "whole.pt"

    def run(*args):
        subprocess.run(
            [sys.executable, str(script), *map(str, args)],
            check=True,
            capture_output=True,
            text=True,
        )

    run("first", split)
    run("second", split)
    run("whole", whole)
    a = torch.load(split, weights_only=True)
    b = torch.load(whole, weights_only=True)
    for k in b["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for i in b["opt"]["state"]:
        for k in b["opt"]["state"][i]:
            assert torch.equal(a["opt"]["state"][i][k], b["opt"]["state"][i][k]), (i, k)
    assert a["graph"]["grad_scaler"] == b["graph"]["grad_scaler"]
    assert a["graph"]["step"] == b["graph"]["step"] == 12
    torch.testing.assert_close(
        a["graph"]["history"]["table"],
        b["graph"]["history"]["table"],
        rtol=0,
        atol=0,
        equal_nan=True,
    )  # unwritten rows are NaN


# -- invalid settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"growth_factor": 1.0}, "growth_factor must be greater than 1"),
        ({"growth_factor": 0.5}, "growth_factor must be greater than 1"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\)"),
        ({"backoff_factor": 0.0}, r"backoff_factor must be in \(0, 1\)"),
        ({"backoff_factor": -0.5}, r"backoff_factor must be in \(0, 1\)"),
        ({"growth_interval": 0}, "growth_interval must be a positive int"),
        ({"growth_interval": 2.5}, "growth_interval must be a positive int"),
        ({"init_scale": 0.0}, "init_scale must be a positive number"),
        ({"init_scale": -1.0}, "init_scale must be a positive number"),
        (
            {"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0},
            "min_scale .* greater than max_scale",
        ),
        ({"init_scale": 2.0**30}, r"init_scale .* within \[min_scale, max_scale\]"),
        ({"hysteresis": 0}, "hysteresis must be a positive int"),
        ({"min_scale": -1.0}, "min_scale must be a number >= 0"),
        ({"max_scale": 0.0}, "max_scale must be a positive number"),
    ],
)
def test_invalid_settings_raise(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        graphamp.GradScaler(**kwargs)


def test_invalid_static_scale_raises():
    with pytest.raises(ConfigError, match="scale must be a positive number"):
        graphamp.StaticGradScaler(0.0)


def test_loading_a_state_dict_without_scaler_keys_raises():
    with pytest.raises(ConfigError, match="lacks"):
        graphamp.GradScaler().load_state_dict({"scale": 2.0})


# -- every state a run produces loads back ------------------------------------------------------


def _advance(scaler, flags) -> None:
    """The step's scale update (``update_scale``, as traced into the step) run eagerly on the
    scaler's own state tensors, one overflow flag per step."""
    scaler._materialize(torch.device("cpu"))
    scale, growth, hysteresis, found = scaler.state_tensors()
    for overflow in flags:
        found.fill_(float(overflow))
        new = scaler.update_scale(scale, growth, hysteresis, found)
        for t, v in zip((scale, growth, hysteresis), new):
            t.copy_(v)


def _random_flags(rng, n: int) -> list[bool]:
    """Bursts of overflows between clean stretches: consecutive overflows, growths, both."""
    flags: list[bool] = []
    while len(flags) < n:
        flags += [rng.random() < 0.5] * rng.randint(1, 6)
    return flags[:n]


def test_every_state_a_run_produces_loads_back_and_continues_the_same():
    """Property-style: 200 random schedules (hysteresis, bounds, factors, intervals) each run
    through random bursts of overflows and clean steps; after every step the saved state loads
    into a fresh scaler made the same way, and both then run the rest of the sequence to the
    same state. Includes runs of consecutive overflows (the hysteresis tracker at 0) and
    scalers without a floor whose scale underflows to 0."""
    import random

    rng = random.Random(0)
    for case in range(200):
        min_scale = rng.choice([0.0, 1.0, 2.0**-3])
        max_scale = rng.choice([2.0**24, math.inf, 2.0**9])
        kwargs = {
            "init_scale": rng.choice([2.0**8, 2.0**9, 1.0, 2.0**-3]),
            "growth_factor": rng.choice([2.0, 1.5, 3.0]),
            "backoff_factor": rng.choice([0.5, 0.25, 0.9]),
            "growth_interval": rng.randint(1, 4),
            "hysteresis": rng.randint(1, 3),
            "min_scale": min_scale,
            "max_scale": max_scale,
        }
        kwargs["init_scale"] = min(max(kwargs["init_scale"], min_scale), max_scale)
        flags = _random_flags(rng, 40) + ([True] * 160 if case % 20 == 0 else [])
        cut = rng.randint(1, len(flags) - 1)
        whole = graphamp.GradScaler(**kwargs)
        _advance(whole, flags[:cut])
        state = whole.state_dict()
        resumed = graphamp.GradScaler(**kwargs)
        resumed.load_state_dict(state)  # it loads ...
        assert resumed.state_dict() == state, (case, kwargs, flags[:cut])
        _advance(whole, flags[cut:])
        _advance(resumed, flags[cut:])
        assert resumed.state_dict() == whole.state_dict(), (case, kwargs, flags)  # ... and runs on
        assert 0 <= whole.state_dict()["_hysteresis_tracker"] <= kwargs["hysteresis"]


def test_a_torch_scalers_state_after_its_scale_underflowed_loads_everywhere():
    """torch.amp.GradScaler backs off without a floor: after enough overflows its scale is 0.
    That state loads into graphamp's scaler without a floor, into a taken-over torch scaler and
    back into torch; a scaler with a floor refuses it by name and is left as it was."""
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    graph_scaler = graphamp.GradScaler(init_scale=2.0**16, min_scale=0.0, max_scale=math.inf)
    taken = TakenOverGradScaler(torch.amp.GradScaler("cpu", init_scale=2.0**16))
    for s in (graph_scaler, taken):
        _advance(s, [True] * 200)
    weight = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([weight], lr=0.1)
    for _ in range(200):  # torch's documented recipe, every step overflowing
        opt.zero_grad()
        theirs.scale((weight * float("inf")).sum()).backward()
        theirs.step(opt)
        theirs.update()
    assert theirs.get_scale() == graph_scaler.get_scale() == taken.get_scale() == 0.0
    for state in (theirs.state_dict(), graph_scaler.state_dict(), taken.state_dict()):
        for target in (
            graphamp.GradScaler(min_scale=0.0),
            TakenOverGradScaler(torch.amp.GradScaler("cpu")),
            torch.amp.GradScaler("cpu"),
        ):
            target.load_state_dict(state)
            assert target.get_scale() == 0.0
    floored = graphamp.GradScaler(init_scale=8.0)
    before = floored.state_dict()
    with pytest.raises(ConfigError, match="loaded scale"):
        floored.load_state_dict(theirs.state_dict())
    assert floored.state_dict() == before


def test_a_graph_resumes_from_a_state_saved_after_consecutive_overflows():
    """Through real steps: three overflowing batches in a row, the graph's state saved, loaded
    into a new Graph over a copy of the model, and both go on to the same scales and weights."""
    kwargs = {"init_scale": 2.0**8, "growth_interval": 2, "hysteresis": 2}
    model = seed_mlp()
    twin = copy.deepcopy(model)
    data = _batches(8, poison={1, 2, 3})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = _quiet_graph(model, nn.CrossEntropyLoss(), opt, scaler=graphamp.GradScaler(**kwargs))
    for x, y in data[:4]:
        g(x, y)
    saved = g.state_dict()
    assert saved["grad_scaler"]["_hysteresis_tracker"] == 0
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    twin_opt.load_state_dict(opt.state_dict())
    h = _quiet_graph(twin, nn.CrossEntropyLoss(), twin_opt, scaler=graphamp.GradScaler(**kwargs))
    h.load_state_dict(saved)
    for x, y in data[4:]:
        g(x, y)
        h(x, y)
    assert g.grad_scaler.state_dict() == h.grad_scaler.state_dict()
    assert g.history.fetch()["scale"][4:] == h.history.fetch()["scale"][4:]
    assert_state_close(model, twin, rtol=0, atol=0)


def test_history_step_numbers_stay_exact_past_float32s_integers():
    """Step numbers past 2**24 (float32 rounds 2**24 + 1 to 2**24) stay exact in the history and
    in the overflow record; a saved table loads into a history of another capacity with its
    last rows in step order."""
    from graphamp.records.history import TrainingHistory

    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        scaler=graphamp.GradScaler(init_scale=2.0**8),
        configure=lambda g: g.config.enable_overflow_tracing(),
    )
    start = 2**24 + 1
    table = torch.full((g.history.capacity, 5), float("nan"), dtype=torch.float64)
    g.history.load_state_dict({"step": start, "table": table})
    for x, y in _batches(3, poison={1}):
        g(x, y)
    rows = g.history.fetch()
    assert rows["step"][-3:] == [start, start + 1, start + 2]
    assert [e.step for e in g.overflow_report().events] == [start + 1]
    small = TrainingHistory(capacity=2)
    small.load_state_dict(g.history.state_dict())
    assert small.fetch()["step"] == [start + 1, start + 2]
    assert small.fetch()["skipped"] == [1.0, 0.0]
