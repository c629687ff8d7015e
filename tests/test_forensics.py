"""Overflow forensics (which op went non-finite first, and where) and self-healing AMP
(autofix pins it to fp32 and training goes on), on the classic cases: T5's feed-forward output
layer, an exp and a large matmul in fp16, an inf in a BatchNorm CNN's batch (a data fault).
Every case is checked against eager PyTorch: the fp32 run the healed training must follow, and
eager autocast + torch.amp.GradScaler on the same model, which keeps skipping."""

from __future__ import annotations

import copy
import inspect
import logging
import os
import subprocess
import sys

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import autocast_step, make_graph
from models import ManualAttentionBlock, SmallCNN, TinyGPT, lm_loss

import graphamp
from graphamp import AmpPin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _line(fn, marker: str) -> str:
    """``file.py:line`` of the line of ``fn`` holding ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{os.path.basename(inspect.getsourcefile(fn))}:{start + offset}"


def _adam(model):
    # the exp model's logits grow fast with its weights: a small step keeps it trainable
    return torch.optim.Adam(model.parameters(), lr=1e-4 if model.kind == "exp" else 3e-2)


def _eager_autocast_skips(model, opt_factory, loss_of, steps: int, init_scale: float = 2.0**16):
    """Skipped steps of eager autocast(fp16) + torch.amp.GradScaler on a copy of ``model``
    (``loss_of(model)`` runs the forward)."""
    model = copy.deepcopy(model)
    opt = opt_factory(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return [
        autocast_step(lambda: loss_of(model), opt, torch.float16, scaler).skipped
        for _ in range(steps)
    ]


def _eager_fp32_losses(model, opt_factory, loss_of, steps: int):
    model = copy.deepcopy(model)
    opt = opt_factory(model)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# -- an exp, and a large matmul, that overflow fp16 ------------------------------------------------


class Overflowing(nn.Module):
    """fc -> exp -> head, or fc -> layer_norm -> head; made to overflow fp16 (not fp32) at the
    exp's fp16 cast for head, or in fc's matmul."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            if kind == "exp":  # exp(11.6..12.4) > 65504: fine in fp32 (exp runs there), not fp16
                self.fc.weight.mul_(0.01)
                self.fc.bias.fill_(12.0)
                self.head.weight.mul_(1e-4)
            else:  # |fc(x)| ~ 1.6e5 > 65504 (weights ~3.5e4)
                self.fc.weight.mul_(1e5)

    def forward(self, x):
        h = self.fc(x)  # overflows: matmul
        if self.kind == "exp":
            h = torch.exp(h)  # overflows: exp
        else:
            h = F.layer_norm(h, h.shape[-1:])
        return self.head(h)  # reads h in fp16


def _batch(seed: int = 0):
    return models.batches(1, 16, 8, 4, seed=seed)[0]


def _overflowing_graph(kind: str, **autofix):
    torch.manual_seed(0)
    model = Overflowing(kind)
    reference = copy.deepcopy(model)

    def configure(g):
        g.config.enable_overflow_tracing()
        if autofix:
            g.config.enable_amp_autofix(**autofix)

    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        _adam(model),
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=16.0),
        configure=configure,
    )
    return g, model, reference


@pytest.mark.parametrize("kind", ["matmul", "exp"])
def test_report_names_the_op_and_line_that_overflowed(kind, tmp_path):
    g, _, _ = _overflowing_graph(kind)
    batch = _batch()
    for _ in range(2):
        g(*batch)
    assert g.history.fetch()["skipped"] == [1.0, 1.0]
    report = g.overflow_report()
    assert report.overflows == 2 and [e.step for e in report.events] == [0, 1]
    event = report.last
    assert event.phase == "forward" and event.value == "inf" and event.dtype == "float16"
    if kind == "matmul":
        assert (event.kind, event.op, event.module) == ("op", "aten.addmm", "model.fc")
        assert event.location == _line(Overflowing.forward, "overflows: matmul")
        assert "self.fc(x)" in event.source
        # it read the batch, fc's weight and bias in fp16 (unchanged: the steps were skipped)
        fc = g.model.fc
        assert event.input_amax == max(
            t.half().abs().max().item() for t in (batch[0], fc.weight, fc.bias)
        )
        assert event.pins == (AmpPin("model.fc", "aten.addmm", 0),)
    else:
        # exp runs in fp32 (deny list); the cast of its result for head's fp16 matmul overflows
        assert event.kind == "cast" and event.module == "model.head"
        exp_node = [
            n
            for n in g.compiled_steps[-1].forward_graph.graph.nodes
            if n.target is torch.ops.aten.exp.default
        ][0]
        assert event.reads == (exp_node.name,)
        assert event.location == _line(Overflowing.forward, "reads h in fp16")
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            h = g.model.fc(batch[0])  # fp16
        expected = torch.exp(h.float()).abs().max().item()  # exp in fp32
        assert event.input_amax == pytest.approx(expected, rel=1e-6)
        assert event.pins == (AmpPin("model.head", "aten.addmm", 0),)
    text = str(report)
    assert "2 overflowing steps" in text and event.location in text
    # report.html shows it; overflows.txt and ranges.csv hold the reports
    out = tmp_path / "dump"
    g.dump(str(out))
    page = (out / "report.html").read_text()
    assert "Overflow forensics" in page and f"node {event.node}" in page
    assert (out / "overflows.txt").read_text().startswith("TrainGraph: 2 overflowing steps")
    assert (out / "ranges.csv").read_text().startswith("node,op,module,dtype")


@pytest.mark.parametrize("kind", ["matmul", "exp"])
def test_autofix_pins_it_and_training_follows_fp32_while_eager_autocast_keeps_skipping(
    kind, caplog
):
    g, model, reference = _overflowing_graph(kind, after=2, max_pins=2)
    batch = _batch()
    with caplog.at_level(logging.INFO, logger="graphamp"):
        losses = [g(*batch).item() for _ in range(7)]
    skipped = g.history.fetch()["skipped"]
    assert skipped == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # pinned after 2, then clean
    expected_pin = AmpPin("model.fc" if kind == "matmul" else "model.head", "aten.addmm", 0)
    assert g.config.amp_pins == (expected_pin,)
    pin_lines = [r for r in caplog.records if "autofix pinned" in r.getMessage()]
    assert len(pin_lines) == 1 and pin_lines[0].levelno == logging.INFO
    assert expected_pin.describe() in pin_lines[0].getMessage()

    # the healed run follows eager fp32 from the same (untouched) weights
    def loss_of(m):
        return F.cross_entropy(m(batch[0]), batch[1])

    fp32 = _eager_fp32_losses(reference, _adam, loss_of, 5)
    torch.testing.assert_close(torch.tensor(losses[2:]), torch.tensor(fp32), rtol=2e-3, atol=1e-3)
    assert fp32[-1] != pytest.approx(fp32[0], rel=0.05)  # a trajectory, not a constant
    # eager autocast + GradScaler on the same model skips every step (recorded, not fixed)
    assert _eager_autocast_skips(reference, _adam, loss_of, 7, 16.0) == [True] * 7


# -- T5: the feed-forward output layer (wo) overflows fp16 ------------------------------------------


def _tiny_t5():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    # T5 declares _keep_in_fp32_modules = ["wo"] for this very overflow; graphamp may honour it
    # (pinning wo up front): clear it, so the overflow happens and autofix has to find it
    model._keep_in_fp32_modules = None
    with torch.no_grad():  # large wo weights: the classic fp16 overflow of T5 checkpoints
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(1e5)
    return model


def _t5_step(model, ids, labels):
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5)


@pytest.mark.slow
def test_t5_wo_overflow_is_found_and_healed_while_eager_autocast_keeps_skipping():
    model = _tiny_t5()
    reference = copy.deepcopy(model)
    g = make_graph(
        model,
        None,
        _sgd(model),
        amp=torch.float16,
        scaler=graphamp.GradScaler(),
        build=lambda g, ids, labels: _t5_step(g.model, ids, labels),
        configure=lambda g: g.config.enable_amp_autofix(after=2),
    )
    gen = torch.Generator().manual_seed(0)
    ids, labels = (
        torch.randint(1, 64, (2, 8), generator=gen),
        torch.randint(1, 64, (2, 8), generator=gen),
    )
    losses = [g(ids, labels).item() for _ in range(6)]
    assert g.history.fetch()["skipped"] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    first = g.overflow_report().events[0]
    wo = "model.encoder.block.0.layer.1.DenseReluDense.wo"
    assert (first.phase, first.kind, first.op, first.module, first.dtype) == (
        "forward",
        "op",
        "aten.mm",
        wo,
        "float16",
    )
    assert first.location.startswith("modeling_t5.py:") and "self.wo(hidden_states)" in first.source
    assert g.config.amp_pins == (AmpPin(wo, "aten.mm", 0),)
    # the wo matmul runs in fp32 now, everything else as before
    forward = g.compiled_steps[-1].forward_graph
    mm = [n for n in forward.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert [n.meta["amp_colour"] for n in mm if wo in n.meta["nn_module_stack"]] == ["deny"]
    assert sum(n.meta["amp_colour"] == "allow" for n in mm) == len(mm) - 1

    # from the untouched weights, the healed run follows eager fp32
    def loss_of(m):
        return m(input_ids=ids, labels=labels).loss

    fp32 = _eager_fp32_losses(reference, _sgd, loss_of, 4)
    torch.testing.assert_close(torch.tensor(losses[2:]), torch.tensor(fp32), rtol=5e-3, atol=1e-3)
    assert fp32[-1] < fp32[0] - 0.05  # a trajectory, not a constant
    # eager autocast + torch.amp.GradScaler skips every step of the same model and batch
    assert _eager_autocast_skips(reference, _sgd, loss_of, 6) == [True] * 6


# -- a data fault: an inf in the batch of a BatchNorm CNN ---------------------------------------------


def test_an_inf_in_the_batch_is_reported_as_input_and_autofix_pins_nothing():
    torch.manual_seed(0)
    model = SmallCNN()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.float16,
        scaler=graphamp.GradScaler(),
        configure=lambda g: g.config.enable_amp_autofix(after=1),
    )
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        x = torch.randn(4, 3, 16, 16, generator=gen)
        if step == 2:
            x[1, 2, 3, 4] = float("inf")
        g(x, torch.randint(0, 10, (4,), generator=gen))
    assert g.history.fetch()["skipped"] == [0.0, 0.0, 1.0, 0.0]
    report = g.overflow_report()
    assert report.overflows == 1
    event = report.last
    assert (event.step, event.phase, event.kind, event.op, event.node, event.value) == (
        2,
        "forward",
        "input",
        "input",
        "x",
        "inf",
    )
    assert event.is_data_fault and event.pins == () and "data fault" in event.note
    assert "input 'x'" in str(report)
    assert g.config.amp_pins == ()  # autofix on, after=1: still nothing pinned
    assert len(g.compiled_steps) == 1  # and nothing rebuilt


# -- attention masks: by-design infinities are not overflows ------------------------------------------


def _gpt(scale_out: float | None):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, heads=4, layers=2, seq=16, block=ManualAttentionBlock)
    if scale_out is not None:
        with torch.no_grad():
            model.blocks[1].out.weight.mul_(scale_out)
    g = make_graph(
        model,
        lm_loss,
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=256.0),
        configure=lambda g: g.config.enable_overflow_tracing(),
    )
    gen = torch.Generator().manual_seed(1)
    return (
        g,
        torch.randint(0, 64, (2, 16), generator=gen),
        torch.randint(0, 64, (2, 16), generator=gen),
    )


@pytest.mark.slow
def test_attention_mask_infinities_are_not_blamed():
    # masked_fill(-inf) makes infinities every step; the softmax absorbs them
    g, idx, targets = _gpt(None)
    for _ in range(3):
        g(idx, targets)
    assert g.history.fetch()["skipped"] == [0.0] * 3
    assert g.overflow_report().overflows == 0
    # with block 1's output projection overflowing, the report names it, not the mask
    g, idx, targets = _gpt(2e5)
    g(idx, targets)
    event = g.overflow_report().last
    assert event.module == "model.blocks.1.out" and event.op in ("aten.addmm", "aten.mm")
    assert event.location == _line(ManualAttentionBlock.forward, "self.out(")
    mask = [
        n
        for n in g.compiled_steps[-1].forward_graph.graph.nodes
        if n.target is torch.ops.aten.masked_fill.Scalar
    ]
    assert mask and all(n.args[2] == float("-inf") for n in mask)  # the infinities were there


# -- the loss scale's own overflows are the scaler's business ------------------------------------------


def test_gradient_overflows_under_a_large_loss_scale_are_left_to_the_scaler():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=2.0**24),
        configure=lambda g: g.config.enable_amp_autofix(after=1),
    )
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    for _ in range(12):
        g(x, y)
    skipped = g.history.fetch()["skipped"]
    assert skipped[0] == 1.0 and skipped[-1] == 0.0  # backed off until the gradients fit
    events = g.overflow_report().events
    assert len(events) == sum(skipped) and all(e.phase == "backward" for e in events)
    assert all(e.pins == () and "backs off" in e.note for e in events)
    assert g.config.amp_pins == ()


# -- pins: kept by state_dict, listed, cleared ---------------------------------------------------------


def test_pins_survive_a_resume_and_can_be_cleared(tmp_path):
    g, model, _ = _overflowing_graph("matmul", after=1)
    batch = _batch()
    for _ in range(3):
        g(*batch)
    pin = AmpPin("model.fc", "aten.addmm", 0)
    assert g.config.amp_pins == (pin,) and g.config.amp_pins[0].step == 0
    path = tmp_path / "graph.pt"
    torch.save({"model": model.state_dict(), "graph": g.state_dict()}, path)
    saved = torch.load(path, weights_only=True)
    assert saved["graph"]["amp_pins"][0]["op"] == "aten.addmm"
    assert len(saved["graph"]["history"]["overflows"]) == 1

    resumed, model2, _ = _overflowing_graph("matmul")  # tracing on, no autofix
    model2.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["graph"])
    assert resumed.config.amp_pins == (pin,) and "autofix" in resumed.config.amp_pins[0].reason
    resumed(*batch)
    assert g.history.fetch()["skipped"] == [1.0, 0.0, 0.0]
    assert resumed.history.fetch()["skipped"] == [1.0, 0.0, 0.0, 0.0]  # pinned from the start
    assert resumed.overflow_report().events[0].module == "model.fc"  # the saved event

    resumed.config.clear_amp_pins()
    resumed(*batch)
    assert resumed.config.amp_pins == () and resumed.history.fetch()["skipped"][-1] == 1.0


def test_a_resumed_run_pins_when_an_uninterrupted_one_does_and_a_load_restores_the_saved_pins():
    """autofix after=3: the uninterrupted run pins after its third overflowing step. A run saved
    after two of them and resumed in a new Graph pins after the same step (the partial count is
    in the state). Loading that checkpoint back into the first Graph, which has pinned since,
    restores exactly what was saved: no autofix pin, the count of 2; a pin written in code
    stays, and the Graph pins again after one more overflowing step."""
    batch = _batch()
    whole, model, _ = _overflowing_graph("matmul", after=3)
    in_code = AmpPin("model.head", "aten.addmm", 0)
    whole.config.pin_fp32(in_code)
    states = []
    for _ in range(4):
        states.append((copy.deepcopy(model.state_dict()), whole.state_dict()))
        whole(*batch)
    pin = AmpPin("model.fc", "aten.addmm", 0)
    assert whole.config.amp_pins == (in_code, pin) and whole.config.amp_pins[1].step == 2
    assert whole.history.fetch()["skipped"] == [1.0, 1.0, 1.0, 0.0]

    model_state, graph_state = states[2]  # after two overflowing steps
    assert graph_state["autofix_counts"] == [{"pins": [pin.to_dict()], "count": 2}]
    resumed, model2, _ = _overflowing_graph("matmul", after=3)
    resumed.config.pin_fp32(in_code)
    model2.load_state_dict(model_state)
    resumed.load_state_dict(graph_state)
    for _ in range(2):
        resumed(*batch)
    assert resumed.config.amp_pins == whole.config.amp_pins
    assert resumed.config.amp_pins[1].step == 2
    assert resumed.history.fetch()["skipped"] == whole.history.fetch()["skipped"]

    model.load_state_dict(model_state)  # back to the checkpoint in the Graph that pinned since
    whole.load_state_dict(graph_state)
    assert whole.config.amp_pins == (in_code,)
    assert whole.state_dict()["autofix_counts"] == graph_state["autofix_counts"]
    whole(*batch)  # the third overflowing step again: pinned after it, as the first time
    assert whole.config.amp_pins == (in_code, pin)


@pytest.mark.parametrize(
    "part, value, message",
    [
        ("amp_pins", [{"module": "model.fc", "op": "aten.addmm", "index": 1.5}], "index"),
        ("amp_pins", [{"module": "model.fc", "op": "aten.mm", "step": -1}], "step"),
        ("autofix_counts", [{"pins": [], "count": 0}], "autofix count"),
        ("autofix_counts", {"pins": 3}, "autofix counts must be a list"),
    ],
)
def test_loaded_pins_and_counts_are_checked_as_their_constructors_check(part, value, message):
    g, _, _ = _overflowing_graph("matmul", after=3)
    g(*_batch())
    good = g.state_dict()
    with pytest.raises(graphamp.ConfigError, match=message):
        g.load_state_dict({**good, part: value})
    assert g.state_dict()["autofix_counts"] == good["autofix_counts"]
    assert g.config.amp_pins == ()


def test_states_saved_before_pins_existed_still_load():
    g, _, _ = _overflowing_graph("matmul")
    g(*_batch())
    state = g.state_dict()
    del state["amp_pins"], state["ranges"]
    del state["history"]["overflows"], state["history"]["overflows_lost"]
    fresh, _, _ = _overflowing_graph("matmul")
    fresh.load_state_dict(state)
    assert fresh.config.amp_pins == () and fresh.overflow_report().overflows == 0


def test_analysis_follows_the_non_finite_values_to_the_loss():
    """A by-design infinity the softmax absorbs comes first in topological order; the overflow
    that reached the loss is the one reported."""
    from graphamp.forensics.analysis import analyse
    from graphamp.records.probes import ROW_HEADER, GradParam, Probe, ProbeTable

    def op(name, inputs, dtype=torch.float16):
        return Probe(
            name,
            name,
            "op",
            f"aten.{name}",
            dtype,
            "m",
            None,
            inputs,
            AmpPin("m", f"aten.{name}", 0),
        )

    table = ProbeTable(
        (
            Probe("x", "x", "input", "", torch.float32, "", None, (), None),
            op("masked_fill", (0,)),
            op("softmax", (1,)),
            op("mm", (0, 2)),
            op("loss", (3,), torch.float32),
        ),
        (GradParam("w", (3,)),),
        (4,),
    )
    inf, nan = float("inf"), float("nan")
    forward = [1.0, inf, 0.5, inf, nan]
    row = [7.0, 1024.0] + forward + [0.0] * 5 + [nan]
    assert len(row) == ROW_HEADER + table.size
    event = analyse(table, row)
    assert (event.step, event.scale, event.node, event.reads) == (7, 1024.0, "mm", ("x", "softmax"))
    assert event.input_amax == 1.0 and event.pins == (AmpPin("m", "aten.mm", 0),)
    # the same infinity in the input instead: a data fault, nothing to pin
    event = analyse(table, [7.0, 1024.0, inf, inf, nan, nan, nan] + [0.0] * 5 + [nan])
    assert event.kind == "input" and event.pins == ()


# -- ranges: headroom against fp16's 65504 ------------------------------------------------------------


def test_ranges_match_eager_autocast_values_and_gradients(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.0),
        amp=torch.float16,
        scaler=graphamp.StaticGradScaler(128.0),
        configure=lambda g: g.config.enable_overflow_tracing(),
    )
    x, y = torch.randn(16, 32) * 3, torch.randint(0, 4, (16,))
    for _ in range(2):
        g(x, y)
    report = g.range_report()
    first = next(r for r in report.rows if r.module == "model.0" and r.op == "aten.addmm")
    # the oracle: eager autocast (fp16 linear), the gradient of its output scaled by 128
    with torch.autocast("cpu", dtype=torch.float16):
        h = model[0](x)
        h.retain_grad()
        logits = model[2](model[1](h))
    (F.cross_entropy(logits.float(), y) * 128.0).backward()
    assert first.dtype == "float16" and first.dtype_max == 65504.0
    assert first.activation_amax == pytest.approx(h.abs().max().item(), rel=1e-3)
    assert first.gradient_amax == pytest.approx(h.grad.abs().max().item(), rel=2e-2)
    assert first.headroom == pytest.approx(
        65504.0 / max(first.activation_amax, first.gradient_amax)
    )
    assert all(r.dtype == "float16" for r in report.rows)  # low-precision values only
    assert "headroom" in str(report) and report.tightest(1)[0].headroom <= first.headroom
    # saved with the state, drawn by `python -m graphamp plot --headroom`
    state = tmp_path / "state.pt"
    torch.save(g.state_dict(), state)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphamp",
            "plot",
            str(state),
            "--headroom",
            "--out",
            str(tmp_path / "headroom.png"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "headroom.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- sync-free, and nothing when off ------------------------------------------------------------------


def test_the_record_stays_on_the_device_until_asked(monkeypatch):
    from graphamp.forensics.device_record import ForensicsState

    reads = []
    original = ForensicsState.read_new
    monkeypatch.setattr(ForensicsState, "read_new", lambda self: reads.append(1) or original(self))
    g, _, _ = _overflowing_graph("matmul")
    for _ in range(3):
        g(*_batch())
    assert reads == []  # three overflowing steps, not one read
    step = g.compiled_steps[-1].step_graph
    assert not [
        n for n in step.graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default
    ]  # no .item() inside
    assert any(n.meta.get("graphamp_subgraph") == "forensics" for n in step.graph.nodes)
    assert g.overflow_report().overflows == 3 and reads == [1]


def test_tracing_off_adds_nothing():
    model = nn.Sequential(nn.Linear(8, 4))
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.float16,
        scaler=graphamp.GradScaler(),
    )
    g(*(_batch()[0], _batch()[1]))
    step = g.compiled_steps[-1].step_graph
    assert not any(n.meta.get("graphamp_subgraph") == "forensics" for n in step.graph.nodes)
    assert not any(n.name.startswith("forensics") for n in step.graph.nodes)
    with pytest.raises(graphamp.ConfigError, match="enable_overflow_tracing"):
        g.overflow_report()
    with pytest.raises(graphamp.ConfigError, match="enable_overflow_tracing"):
        g.range_report()
    with pytest.raises(graphamp.ConfigError, match="enable_amp_autofix"):
        g.config.enable_amp_autofix(after=0)
    g.config.enable_amp_autofix()
    assert g.config.overflow_tracing  # autofix turns tracing on
    with pytest.raises(graphamp.ConfigError, match="enable_amp_autofix\\(False\\)"):
        g.config.enable_overflow_tracing(False)


def _step_ops(step_graph, *, without_forensics: bool) -> dict:
    """Multiset of (op, subgraph) of a step graph's nodes; placeholders by name."""
    from collections import Counter

    ops = Counter()
    for n in step_graph.graph.nodes:
        tag = n.meta.get("graphamp_subgraph")
        writes_forensics = n.target is torch.ops.aten.copy_.default and n.args[0].name.startswith(
            "forensics"
        )  # the record's in-place writes
        if without_forensics and (
            tag == "forensics" or n.name.startswith("forensics") or writes_forensics
        ):
            continue
        ops[(n.op, str(n.target) if n.op != "placeholder" else n.name, tag)] += 1
    return ops


def test_tracing_off_compiles_exactly_the_traced_step_minus_its_probes(caplog):
    # off costs nothing: the untraced step has the traced step's nodes but the forensics ones,
    # no more; turning tracing on later recaptures and the log names the setting
    torch.manual_seed(0)
    model = SmallCNN()
    graphs = []
    for traced in (False, True):
        m = copy.deepcopy(model)
        graphs.append(
            make_graph(
                m,
                nn.CrossEntropyLoss(),
                torch.optim.SGD(m.parameters(), lr=0.1),
                amp=torch.float16,
                scaler=graphamp.GradScaler(),
                configure=(lambda g: g.config.enable_overflow_tracing()) if traced else None,
            )
        )
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    losses = [g(x, y).item() for g in graphs]
    assert losses[0] == losses[1]  # probes read values, never change them
    off, on = (g.compiled_steps[-1].step_graph for g in graphs)
    assert _step_ops(off, without_forensics=False) == _step_ops(on, without_forensics=True)
    assert sum(n.meta.get("graphamp_subgraph") == "forensics" for n in on.graph.nodes) > 10
    with caplog.at_level(logging.INFO, logger="graphamp"):
        graphs[0].config.enable_overflow_tracing()
        graphs[0](x, y)
    assert len(graphs[0].compiled_steps) == 2
    assert any(
        "overflow_tracing" in r.getMessage() and "compiling again" in r.getMessage()
        for r in caplog.records
    )


def test_debug_1_logs_each_overflow_as_it_happens(caplog):
    g, _, _ = _overflowing_graph("matmul")
    g.debug(1)
    with caplog.at_level(logging.INFO, logger="graphamp"):
        for _ in range(2):
            g(*_batch())
    lines = [r.getMessage() for r in caplog.records if "overflow at" in r.getMessage()]
    assert len(lines) == 2 and all(
        r.levelno == logging.INFO for r in caplog.records if "overflow at" in r.getMessage()
    )
    location = _line(Overflowing.forward, "overflows: matmul")
    assert "aten.addmm" in lines[0] and "model.fc" in lines[0] and location in lines[0]
    assert "step 0" in lines[0] and "step 1" in lines[1]
    # read once each, not again by the report
    assert [e.step for e in g.overflow_report().events] == [0, 1]


@pytest.mark.usefixtures("sigint_raises")
def test_the_overflow_record_is_part_of_the_step_transaction(monkeypatch):
    import signal

    g, _, _ = _overflowing_graph("matmul")
    g.debug(1)  # the host reads the record after every step
    g(*_batch())
    runner = g._programs[next(iter(g._programs))].runner  # inject failures
    forensics = runner.forensics
    assert int(forensics.count) == 1 and len(g.overflow_report().events) == 1
    ring = forensics.ring.clone()

    # an error in the compiled step: no record, no event, no step
    compiled = runner.compiled
    monkeypatch.setattr(
        runner,
        "compiled",
        lambda *flat: (_ for _ in ()).throw(RuntimeError("injected failure in the compiled step")),
    )
    with pytest.raises(RuntimeError, match="injected"):
        g(*_batch())
    assert g.step_count == 1 and int(forensics.count) == 1
    torch.testing.assert_close(forensics.ring, ring, rtol=0, atol=0, equal_nan=True)
    assert len(g.overflow_report().events) == 1
    monkeypatch.setattr(runner, "compiled", compiled)

    # Ctrl-C while the host reads the record: held until the read is stored, then raised; the
    # step counts, its event is kept once, and nothing is read twice
    read_new = forensics.read_new

    def interrupted_read():
        os.kill(os.getpid(), signal.SIGINT)
        return read_new()

    monkeypatch.setattr(forensics, "read_new", interrupted_read)
    with pytest.raises(KeyboardInterrupt):
        g(*_batch())
    monkeypatch.setattr(forensics, "read_new", read_new)
    assert g.step_count == 2 and int(forensics.count) == 2 and forensics.analysed == 2
    assert [e.step for e in g.overflow_report().events] == [0, 1]
    assert g.history.fetch()["skipped"] == [1.0, 1.0]


def test_autofix_pins_the_op_first_then_its_module_and_respects_max_pins(caplog):
    # a structure test of the host-side policy on synthetic events: op pin after K steps, the
    # module when the op pin did not suffice (replacing it), never past max_pins, never a data
    # fault
    from graphamp.config import GraphConfig
    from graphamp.forensics.autofix import Autofix
    from graphamp.records.probes import OverflowEvent

    def event(step, pins, kind="op"):
        return OverflowEvent(
            step,
            1024.0,
            "forward",
            kind,
            "mm",
            "aten.mm",
            "float16",
            "model.ff",
            "",
            "model.py:3",
            "inf",
            7e4,
            pins=pins,
        )

    config = GraphConfig()
    config.enable_amp(True)
    config.enable_amp_autofix(max_pins=2, after=2)
    fix = Autofix()
    op = AmpPin("model.ff", "aten.mm", 0)
    with caplog.at_level(logging.INFO, logger="graphamp"):
        assert fix.consider("G", [event(0, (op,))], config) == []  # 1 < after
        assert fix.consider("G", [event(1, ())], config) == []  # nothing to pin: not counted
        assert fix.consider("G", [event(2, (), kind="input")], config) == []  # data fault
        (made,) = fix.consider("G", [event(3, (op,))], config)
        assert (made.module, made.op, made.index, made.step) == ("model.ff", "aten.mm", 0, 3)
        assert config.amp_pins == (made,)
        # the same module overflows again with the op pinned: the module replaces the op pin
        other = AmpPin("model.ff", "aten.addmm", 1)
        assert fix.consider("G", [event(4, (other,))], config) == []
        (module,) = fix.consider("G", [event(5, (other,))], config)
        assert (module.module, module.op) == ("model.ff", None) and config.amp_pins == (module,)
        # max_pins=2: one more pin fits, a third does not (a warning, nothing pinned)
        third, fourth = AmpPin("model.a", "aten.mm", 0), AmpPin("model.b", "aten.mm", 0)
        fix.consider("G", [event(6, (third,)), event(7, (third,))], config)
        assert len(config.amp_pins) == 2
        assert fix.consider("G", [event(8, (fourth,)), event(9, (fourth,))], config) == []
        assert len(config.amp_pins) == 2
    pinned = [r for r in caplog.records if "autofix pinned" in r.getMessage()]
    assert len(pinned) == 3 and "replaces the op pins" in pinned[1].getMessage()
    assert any(
        "max_pins=2" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records
    )
    config.clear_amp_pins()
    assert config.amp_pins == ()


def test_the_range_report_marks_the_value_that_overflowed():
    """The ranges keep finite magnitudes only: the cast that overflowed would show its
    pre-overflow magnitude and room to spare. It is marked, with no headroom, and comes first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    g = make_graph(
        model,
        F.mse_loss,
        torch.optim.SGD(model.parameters(), lr=0.01),
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=2.0**10),
        configure=lambda g: g.config.enable_overflow_tracing(),
    )
    for i in range(4):
        x = torch.randn(8, 8) * (1e5 if i == 2 else 1.0)
        g(x, torch.randn(8, 4))
    (event,) = g.overflow_report().events
    report = g.range_report()
    first = report.tightest(1)[0]
    assert first.node == event.node and first.overflows == 1 and first.headroom == 0.0
    assert "overflowed" in str(report).splitlines()[2]
    kept = {row["node"]: row["overflows"] for row in g.state_dict()["ranges"]}
    assert kept[event.node] == 1  # kept in the state dict too
