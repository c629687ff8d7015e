"""fp32 where faster (passes/fp32_where_faster.py): attention timed in both precisions at its
sizes, kept fp32 where fp32 measured faster. The choice is tested with timings given by the
test (a machine's real timings decide it in use); the timing itself on real kernels."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import make_graph
from models import TinyGPT, lm_loss

from graphamp import ConfigError
from graphamp.passes import fp32_where_faster as speed

SDPA_OP = "graphamp.scaled_dot_product_attention"


@pytest.fixture
def timings(monkeypatch):
    """The timings the pass sees: ``timings.low`` and ``timings.fp32`` in ms; each call is
    recorded in ``timings.calls`` (what was timed)."""

    class Given:
        low, fp32 = 2.0, 0.5
        calls: list = []

    def fake(timed, low_dtype):
        Given.calls.append((timed.key, low_dtype))
        return Given.low, Given.fp32

    monkeypatch.setattr(speed, "_timings", fake)
    monkeypatch.setattr(speed, "MIN_TIMED_MACS", 0)  # TinyGPT's attention is below it
    Given.calls = []
    return Given


def _gpt_graph(configure=None, train=True, dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if train else None
    build = None if train else (lambda self, x, y: lm_loss(self.model(x), y))
    g = make_graph(model, lm_loss, opt, amp=dtype, configure=configure, build=build)
    idx = torch.randint(0, 64, (2, 17))
    loss = g(idx[:, :-1], idx[:, 1:])
    return g, loss


def _attention_rows(g):
    rows = g.precision_report(with_autocast=False).rows
    found = [r for r in rows if r["op"] == SDPA_OP]
    assert len(found) == 2  # TinyGPT's two blocks
    return found


def test_attention_runs_fp32_where_fp32_measured_faster_and_the_report_says_why(timings):
    g, _ = _gpt_graph()
    rows = _attention_rows(g)
    assert {r["colour"] for r in rows} == {"deny"}
    assert {r["dtype"] for r in rows} == {"float32"}
    assert all("faster in fp32 than in bf16 on this machine" in r["why"] for r in rows)
    # both blocks' attention has the same sizes: one timing (the real one is cached per size)
    assert len(timings.calls) == 2 and timings.calls[0][0] == timings.calls[1][0]
    assert timings.calls[0][0][-1] is True  # a training graph: forward and backward timed
    summary = g.precision_report(with_autocast=False).summary()
    assert (
        "2 attention ops kept fp32, faster there on this machine (1.00 ms against 4.00 ms"
        in summary
    )
    # the rest of the block is unchanged: its matmuls stay bf16
    others = g.precision_report(with_autocast=False).rows
    assert any(r["op"] == "aten.addmm" and r["colour"] == "allow" for r in others)


def test_a_near_tie_stays_in_low_precision(timings):
    timings.low, timings.fp32 = 1.1, 1.0  # fp32 faster, by less than the margin
    g, _ = _gpt_graph()
    assert {r["colour"] for r in _attention_rows(g)} == {"allow"}
    assert speed.MARGIN > 1.1


@pytest.mark.parametrize(
    "configure",
    [
        lambda self: self.config.set_fp32_where_faster(False),
        lambda self: self.config.override_amp_lists(allow=[SDPA_OP]),
        lambda self: self.config.set_amp_opt_level("O3"),
    ],
    ids=["off", "user-listed", "O3"],
)
def test_nothing_is_timed_where_the_user_decided(timings, configure):
    g, _ = _gpt_graph(configure)
    assert timings.calls == []
    assert {r["colour"] for r in _attention_rows(g)} == {"allow"}


def test_attention_too_small_to_time_reliably_is_not_timed(timings, monkeypatch):
    monkeypatch.setattr(speed, "MIN_TIMED_MACS", 1e6)  # TinyGPT's: 2*4*16*16*(8+8) = 32k
    g, _ = _gpt_graph()
    assert timings.calls == []
    assert {r["colour"] for r in _attention_rows(g)} == {"allow"}


def test_an_eval_graph_times_the_forward_only(timings):
    _gpt_graph(train=False)
    assert timings.calls and all(key[-1] is False for key, _ in timings.calls)


def test_fp16_is_timed_against_fp16(timings):
    _gpt_graph(dtype=torch.float16)
    assert {low for _, low in timings.calls} == {torch.float16}


def test_the_fp32_attention_step_trains_as_eager_with_fp32_attention(timings):
    """The step with attention kept fp32 against eager autocast whose attention runs outside
    autocast on fp32 inputs: the same computation, so the losses agree closely."""
    torch.manual_seed(0)
    model = TinyGPT()
    ref = TinyGPT()
    ref.load_state_dict(model.state_dict())
    g = make_graph(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                   amp=torch.bfloat16)  # fmt: skip
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    plain = F.scaled_dot_product_attention

    def fp32_attention(q, k, v, *args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return plain(q.float(), k.float(), v.float(), *args, **kwargs).to(q.dtype)

    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        idx = torch.randint(0, 64, (2, 17), generator=gen)
        got = g(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        F.scaled_dot_product_attention = fp32_attention
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = lm_loss(ref(idx[:, :-1]), idx[:, 1:])
        finally:
            F.scaled_dot_product_attention = plain
        want.backward()
        opt.step()
        assert abs(float(got) - float(want)) < 2e-2, (float(got), float(want))


def test_the_settings_turn_off_across_ranks_and_off_the_cpu(monkeypatch):
    g, _ = _gpt_graph(lambda self: self.config.set_backend("eager"))
    config = g.config.snapshot()
    args = ("g", True, lambda paths, setter: None)
    assert speed.speed_settings(config, torch.device("cpu"), *args)
    assert speed.speed_settings(config, torch.device("cuda"), *args) == {}
    monkeypatch.setattr(speed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(speed.dist, "get_world_size", lambda group=None: 2)
    assert speed.speed_settings(config, torch.device("cpu"), *args) == {}


def test_set_fp32_where_faster_checks_its_argument():
    g, _ = _gpt_graph(lambda self: self.config.set_backend("eager"))
    with pytest.raises(ConfigError, match="set_fp32_where_faster"):
        g.config.set_fp32_where_faster("yes")


def test_real_timings_are_positive_and_kept_per_size(monkeypatch):
    """The timing on real kernels: both precisions give a finite time, and a size is timed
    once per process."""
    monkeypatch.setattr(speed, "MIN_TIMED_MACS", 0)
    speed._TIMINGS.clear()
    torch.manual_seed(0)
    g, _ = _gpt_graph()
    assert len(speed._TIMINGS) == 1  # the two blocks' attention: one size
    ((key, (low_ms, fp32_ms)),) = speed._TIMINGS.items()
    assert key[-1] == torch.bfloat16
    assert 0 < low_ms < math.inf and 0 < fp32_ms < math.inf
    assert list(json.load(open(speed._record_path())).values()) == [[low_ms, fp32_ms]]


def test_a_later_run_reads_the_machines_recorded_timings_and_makes_the_same_choice(monkeypatch):
    """The first run times a size and records it; a later process (an empty in-process cache)
    reads the record instead of timing again, so noise cannot give it another step."""
    monkeypatch.setattr(speed, "MIN_TIMED_MACS", 0)
    speed._TIMINGS.clear()
    monkeypatch.setattr(speed, "_time_both", lambda timed, low: (2.0, 0.5))
    g, _ = _gpt_graph()
    assert {r["colour"] for r in _attention_rows(g)} == {"deny"}
    record = json.load(open(speed._record_path()))
    assert list(record.values()) == [[2.0, 0.5]]

    speed._TIMINGS.clear()  # as in a new process
    timed_again = []
    monkeypatch.setattr(speed, "_time_both", lambda timed, low: timed_again.append(1) or (0.5, 2.0))
    g, _ = _gpt_graph()
    assert timed_again == [] and {r["colour"] for r in _attention_rows(g)} == {"deny"}


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"k": "v"}'])
def test_a_malformed_record_is_timed_again_and_rewritten(monkeypatch, content):
    monkeypatch.setattr(speed, "MIN_TIMED_MACS", 0)
    speed._TIMINGS.clear()
    path = speed._record_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(content)
    monkeypatch.setattr(speed, "_time_both", lambda timed, low: (0.5, 2.0))
    g, _ = _gpt_graph()
    assert {r["colour"] for r in _attention_rows(g)} == {"allow"}
    assert [0.5, 2.0] in json.load(open(path)).values()


def test_the_cpu_kernel_capture_records_for_multihead_attention_is_timed_too(timings):
    """nn.MultiheadAttention reaches the CPU attention kernel by a name capture does not see, so
    the forward holds the kernel itself; it is timed and kept fp32 the same way."""
    import torch.nn as nn

    class Attend(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
            self.head = nn.Linear(32, 10)

        def forward(self, x):
            return self.head(self.mha(x, x, x, need_weights=False)[0].mean(1))

    torch.manual_seed(0)
    model = Attend()
    g = make_graph(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                   amp=torch.bfloat16)  # fmt: skip
    g(torch.randn(2, 16, 32), torch.randint(0, 10, (2,)))
    rows = g.precision_report(with_autocast=False).rows
    kernel = [r for r in rows if r["op"] == "aten._scaled_dot_product_flash_attention_for_cpu"]
    assert kernel and {r["colour"] for r in kernel} == {"deny"}
    assert timings.calls and timings.calls[0][0][1] == (2, 4, 16, 8)  # (B, H, T, D)
