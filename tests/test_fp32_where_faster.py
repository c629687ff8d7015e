"""fp32 where faster (passes/fp32_where_faster.py): attention timed in both precisions at its
sizes, kept fp32 where fp32 measured faster. The choice is tested with timings given by the
test (a machine's real timings decide it in use); the timing itself on real kernels."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import make_graph
from models import TinyGPT, lm_loss

from graphamp import ConfigError
from graphamp.passes import dense_ops
from graphamp.passes import fp32_where_faster as speed
from graphamp.records.amp import SpeedCheck

SDPA_OP = "graphamp.scaled_dot_product_attention"
# products and convolutions timed here as users' are (conftest leaves them to the lists elsewhere)
pytestmark = pytest.mark.timed_products


@pytest.fixture
def timings(monkeypatch):
    """The timings the pass sees: ``timings.low``, ``timings.fp32`` and ``timings.matmuls``
    in ms; each call is recorded in ``timings.calls`` (what was timed, the low dtype, the
    forms timed)."""

    class Given:
        low, fp32, matmuls = 2.0, 0.5, 4.0
        calls: list = []

    def fake(timed, low_dtype):
        Given.calls.append((timed.key, low_dtype, timed.forms))
        ms = {"low": Given.low, "fp32": Given.fp32, "matmuls": Given.matmuls}
        return {form: ms[form] for form in timed.forms}

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


def _ms(timed, low, fp32, matmuls):
    """Given timings of the forms ``timed`` runs in."""
    ms = {"low": low, "fp32": fp32, "matmuls": matmuls}
    return {form: ms[form] for form in timed.forms}


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
    # a training graph: forward and backward timed; aot_eager runs the matmul form uncompiled
    assert timings.calls[0][0][-2:] == (True, False)
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
    assert timings.calls and all(key[-2] is False for key, *_ in timings.calls)


def test_fp16_is_timed_against_fp16(timings):
    _gpt_graph(dtype=torch.float16)
    assert {low for _, low, _ in timings.calls} == {torch.float16}


def _trains_as_eager_autocast(eager_attention=None):
    """Three SGD steps of TinyGPT's graph against eager autocast on a copy (its attention
    ``eager_attention`` where given): the losses agree as two runs of the same precision do.
    Returns the graph."""
    torch.manual_seed(0)
    model = TinyGPT()
    ref = TinyGPT()
    ref.load_state_dict(model.state_dict())
    g = make_graph(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                   amp=torch.bfloat16)  # fmt: skip
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    plain = F.scaled_dot_product_attention
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        idx = torch.randint(0, 64, (2, 17), generator=gen)
        got = g(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        F.scaled_dot_product_attention = eager_attention or plain
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = lm_loss(ref(idx[:, :-1]), idx[:, 1:])
        finally:
            F.scaled_dot_product_attention = plain
        want.backward()
        opt.step()
        assert abs(float(got) - float(want)) < 2e-2, (float(got), float(want))
    return g


def test_the_fp32_attention_step_trains_as_eager_with_fp32_attention(timings):
    """The step with attention kept fp32 against eager autocast whose attention runs outside
    autocast on fp32 inputs: the same computation, so the losses agree closely."""
    plain = F.scaled_dot_product_attention

    def fp32_attention(q, k, v, *args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return plain(q.float(), k.float(), v.float(), *args, **kwargs).to(q.dtype)

    _trains_as_eager_autocast(fp32_attention)


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
    """The timing on real kernels: every form gives a finite time, and a size is timed once
    per process."""
    monkeypatch.setattr(speed, "MIN_TIMED_MACS", 0)
    speed._TIMINGS.clear()
    torch.manual_seed(0)
    g, _ = _gpt_graph()
    assert len(speed._TIMINGS) == 1  # the two blocks' attention: one size
    ((key, ms),) = speed._TIMINGS.items()
    assert key[-2] == torch.bfloat16 and key[-1] == ("low", "fp32", "matmuls")
    assert all(0 < ms[form] < math.inf for form in key[-1])
    recorded = list(json.load(open(speed._record_path())).values())
    assert recorded == [[ms[form] for form in key[-1]]]


def test_a_later_run_reads_the_machines_recorded_timings_and_makes_the_same_choice(monkeypatch):
    """The first run times a size and records it; a later process (an empty in-process cache)
    reads the record instead of timing again, so noise cannot give it another step."""
    monkeypatch.setattr(speed, "MIN_TIMED_MACS", 0)
    speed._TIMINGS.clear()
    monkeypatch.setattr(speed, "_time_forms", lambda timed, low: _ms(timed, 2.0, 0.5, 4.0))
    g, _ = _gpt_graph()
    assert {r["colour"] for r in _attention_rows(g)} == {"deny"}
    record = json.load(open(speed._record_path()))
    assert list(record.values()) == [[2.0, 0.5, 4.0]]

    speed._TIMINGS.clear()  # as in a new process
    timed_again = []
    monkeypatch.setattr(
        speed, "_time_forms", lambda timed, low: timed_again.append(1) or _ms(timed, 0.5, 2, 4)
    )
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
    monkeypatch.setattr(speed, "_time_forms", lambda timed, low: _ms(timed, 0.5, 2.0, 4.0))
    g, _ = _gpt_graph()
    assert {r["colour"] for r in _attention_rows(g)} == {"allow"}
    assert [0.5, 2.0, 4.0] in json.load(open(path)).values()


class _Attend(torch.nn.Module):
    """nn.MultiheadAttention: it reaches the CPU attention kernel by a name capture does not
    see, so the forward holds the kernel itself."""

    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.mha(x, x, x, need_weights=False)[0].mean(1))


def test_the_cpu_kernel_capture_records_for_multihead_attention_is_timed_too(timings):
    """The kernel's node is timed and kept fp32 as graphamp's own attention op is."""
    torch.manual_seed(0)
    model = _Attend()
    g = make_graph(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                   amp=torch.bfloat16)  # fmt: skip
    g(torch.randn(2, 16, 32), torch.randint(0, 10, (2,)))
    rows = g.precision_report(with_autocast=False).rows
    kernel = [r for r in rows if r["op"] == "aten._scaled_dot_product_flash_attention_for_cpu"]
    assert kernel and {r["colour"] for r in kernel} == {"deny"}
    assert timings.calls and timings.calls[0][0][1] == (2, 4, 16, 8)  # (B, H, T, D)


def test_the_cpu_kernel_is_replaced_by_the_matmul_form_where_that_is_fastest(timings):
    """The kernel's node (output, logsumexp), of which only the output is read, is replaced
    by one ``sdpa_as_matmuls`` node; the step trains as eager autocast does."""
    timings.low, timings.fp32, timings.matmuls = 2.0, 1.5, 0.5
    torch.manual_seed(0)
    model, ref = _Attend(), _Attend()
    ref.load_state_dict(model.state_dict())
    g = make_graph(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                   amp=torch.bfloat16)  # fmt: skip
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(2, 16, 32, generator=gen), torch.randint(0, 10, (2,), generator=gen)
        got = g(x, y)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = F.cross_entropy(ref(x), y)
        want.backward()
        opt.step()
        assert abs(float(got) - float(want)) < 2e-2, (float(got), float(want))
    ops = [r["op"] for r in g.precision_report(with_autocast=False).rows]
    assert "graphamp.sdpa_as_matmuls" in ops
    assert "aten._scaled_dot_product_flash_attention_for_cpu" not in ops


# -- attention written as low-precision matmuls around an fp32 softmax -----------------------------


def test_attention_is_written_as_matmuls_where_that_measured_fastest(timings):
    timings.low, timings.fp32, timings.matmuls = 2.0, 1.5, 0.5
    g, _ = _gpt_graph()
    rows = g.precision_report(with_autocast=False).rows
    found = [r for r in rows if r["op"] == "graphamp.sdpa_as_matmuls"]
    assert len(found) == 2 and not [r for r in rows if r["op"] == SDPA_OP]
    assert {r["colour"] for r in found} == {"allow"} and {r["dtype"] for r in found} == {"bfloat16"}
    assert all("written as bf16 matmuls around an fp32 softmax: faster than" in r["why"]
               for r in found)  # fmt: skip
    assert timings.calls[0][2] == ("low", "fp32", "matmuls")
    summary = g.precision_report(with_autocast=False).summary()
    assert (
        "2 attention ops written as bfloat16 matmuls around an fp32 softmax, faster there on "
        "this machine (1.00 ms against 4.00 ms for the bfloat16 kernel and 3.00 ms for the "
        "fp32 one, timed)" in summary
    )


@pytest.mark.parametrize(
    ("low", "fp32", "matmuls", "form", "kernels_only"),
    [
        (2.0, 1.5, 0.5, "matmuls", "fp32"),  # fastest by the margin over both
        (2.0, 0.5, 0.45, "fp32", "fp32"),  # beats fp32 by less than the margin: fp32, exacter
        (2.0, 3.0, 1.8, "low", "low"),  # beats the kernel by less than the margin
        (2.0, 1.0, 3.0, "fp32", "fp32"),
        (1.0, 1.1, 1.05, "low", "low"),
    ],
)
def test_the_fastest_form_needs_the_margin_over_every_other(low, fp32, matmuls, form, kernels_only):
    assert speed.fastest_form({"low": low, "fp32": fp32, "matmuls": matmuls}) == form
    assert speed.fastest_form({"low": low, "fp32": fp32}) == kernels_only


def test_attention_with_a_mask_is_not_timed_as_matmuls(timings):
    """``sdpa_as_matmuls`` takes no mask (a wholly masked row is the kernels' business): a
    masked attention is timed in the kernel's two precisions only."""
    import torch.nn as nn

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(32, 96)
            self.head = nn.Linear(32, 10)
            mask = torch.rand(2, 1, 16, 16) > 0.3
            mask[..., 0] = True  # no wholly masked row
            self.register_buffer("mask", mask)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
            return self.head(y.transpose(1, 2).reshape(2, 16, 32).mean(1))

    timings.low, timings.fp32, timings.matmuls = 2.0, 1.5, 0.5
    torch.manual_seed(0)
    model = Masked()
    g = make_graph(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                   amp=torch.bfloat16)  # fmt: skip
    g(torch.randn(2, 16, 32), torch.randint(0, 10, (2,)))
    assert timings.calls and all(forms == ("low", "fp32") for *_, forms in timings.calls)
    ops = {r["op"] for r in g.precision_report(with_autocast=False).rows}
    assert "graphamp.sdpa_as_matmuls" not in ops


@pytest.mark.parametrize(
    ("causal", "scale", "gqa"), [(False, None, False), (True, None, False), (True, 0.3, True)]
)
def test_the_matmul_form_computes_what_the_attention_kernel_does(causal, scale, gqa):
    """In fp32 the two agree to rounding; in bf16 they agree as two bf16 kernels do."""
    from graphamp.torchkit.op_math import sdpa_as_matmuls

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 8, generator=gen)
    k, v = (torch.randn(2, 2 if gqa else 4, 12, 8, generator=gen) for _ in range(2))
    kwargs = {"is_causal": causal, "scale": scale, "enable_gqa": gqa}
    want = F.scaled_dot_product_attention(q, k, v, **kwargs)
    got = sdpa_as_matmuls(q, k, v, None, 0.0, causal, scale, gqa)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    low = [t.bfloat16() for t in (q, k, v)]
    got_low = sdpa_as_matmuls(*low, None, 0.0, causal, scale, gqa)
    assert got_low.dtype == torch.bfloat16
    torch.testing.assert_close(got_low.float(), want, rtol=0.05, atol=0.02)


def test_the_matmul_attention_step_trains_as_eager_autocast(timings):
    """The step with attention written as matmuls against eager autocast (bf16 attention
    kernel): the same precision, so the losses agree as two bf16 runs do."""
    timings.low, timings.fp32, timings.matmuls = 2.0, 1.5, 0.5
    g = _trains_as_eager_autocast()
    ops = {r["op"] for r in g.precision_report(with_autocast=False).rows}
    assert "graphamp.sdpa_as_matmuls" in ops


@pytest.mark.parametrize("heads_kv", [4, 2])
def test_the_matmul_form_is_timed_by_its_kernels_where_inductor_fuses_the_rest(heads_kv):
    """With inductor as the step's backend the matmul form's time is its products' and
    softmax's (the casts and the scale fuse into the softmax there): finite for the forward
    and for forward and backward, grouped-query heads included, and nothing is compiled."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=gen).bfloat16()
    k, v = (torch.randn(2, heads_kv, 16, 8, generator=gen).bfloat16() for _ in range(2))
    grad = torch.ones(2, 4, 16, 8, dtype=torch.bfloat16)
    forward = speed._matmul_kernels(q, k, v)
    both = speed._matmul_kernels(q, k, v, grad)
    assert 0 < forward < math.inf and 0 < both < math.inf


def test_the_matmul_form_is_timed_by_its_kernels_where_the_step_is_compiled_by_inductor():
    g, _ = _gpt_graph(lambda self: self.config.set_backend("eager"))
    args = ("g", True, lambda paths, setter: None)
    for backend, compiled in (("eager", False), ("aot_eager", False), ("inductor", True)):
        g.config.set_backend(backend)
        config = g.config.snapshot()
        check = speed.speed_settings(config, torch.device("cpu"), *args)["speed_check"]
        assert check.compiled is compiled


# matrix products and convolutions (dense_ops.py): on a CPU without bf16 or fp16 instructions
# their low-precision kernels are the slow ones


class _Wide(torch.nn.Module):
    """Two linear layers and a convolution, each above dense_ops.MIN_MACS at batch 8."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 16, 3)
        self.fc1 = torch.nn.Linear(16 * 14 * 14, 256)
        self.fc2 = torch.nn.Linear(256, 512)  # 8 * 256 * 512 = 1048576 multiply-adds
        self.head = torch.nn.Linear(512, 4)  # 8 * 512 * 4: too small to time

    def forward(self, x):
        h = self.conv(x).relu().flatten(1)
        return self.head(self.fc2(self.fc1(h).relu()))


def _wide_graph(configure=None, backend="aot_eager"):
    torch.manual_seed(0)
    model = _Wide()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = make_graph(model, F.cross_entropy, opt, amp=torch.bfloat16, configure=configure,
                   backend=backend)  # fmt: skip
    return model, opt, g


def _wide_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, 16, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def _rows_of(g, ops):
    return [r for r in g.precision_report(with_autocast=False).rows if r["op"] in ops]


DENSE = ("aten.addmm", "aten.mm", "aten.convolution")


def test_matrix_products_and_convolutions_run_fp32_where_fp32_measured_faster(timings):
    model, opt, g = _wide_graph()
    g(*_wide_batch())
    rows = _rows_of(g, DENSE)
    kept = [r for r in rows if r["colour"] == "deny"]
    assert {r["op"] for r in kept} == {"aten.addmm", "aten.convolution"} and len(kept) == 3
    assert all("faster in fp32 than in bf16 on this machine" in r["why"] for r in kept)
    assert [r["module"] for r in rows if r["colour"] == "allow"] == ["model.head"]  # not timed
    summary = g.precision_report(with_autocast=False).summary()
    assert "2 matrix products and 1 convolution kept fp32, faster there on this machine" in (
        summary
    )
    timed = [call[0][0] for call in timings.calls]
    assert sorted(timed) == ["aten.addmm.default"] * 2 + ["aten.convolution.default"]


def test_the_step_with_its_products_kept_fp32_trains_as_eager_does(timings):
    """Every timed op kept fp32 and the head's product in bf16: the losses of three steps
    agree with eager autocast on a copy whose timed layers run outside autocast."""
    model, opt, g = _wide_graph()
    eager = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    for step in range(3):
        x, y = _wide_batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            h = eager.fc2(eager.fc1(eager.conv(x).relu().flatten(1)).relu())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = F.cross_entropy(eager.head(h), y)
        eager_opt.zero_grad()
        want.backward()
        eager_opt.step()
        got = g(x, y)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-6)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_matrix_products_the_user_listed_or_in_fp8_are_not_timed(timings):
    _, _, g = _wide_graph(lambda self: self.config.override_amp_lists(allow=["addmm"]))
    g(*_wide_batch())
    assert [call[0][0] for call in timings.calls] == ["aten.convolution.default"]
    assert {r["colour"] for r in _rows_of(g, ("aten.addmm",))} == {"allow"}


def test_matmuls_the_fp8_pass_rewrites_are_left_to_it(timings):
    """With enable_fp8 the linear layers' matmuls are the fp8 pass's (the user asked for fp8):
    not timed, whatever fp32's speed, and left in bf16 for it; the convolution is timed."""
    configure = lambda self: self.config.enable_fp8(keep_first_last=False)  # noqa: E731
    _, _, g = _wide_graph(configure)
    g(*_wide_batch())
    assert [call[0][0] for call in timings.calls] == ["aten.convolution.default"]
    rows = g.precision_report(with_autocast=False).rows
    fc = [r for r in rows if r["module"] in ("model.fc1", "model.fc2") and r["op"] == "aten.addmm"]
    assert len(fc) == 2 and all(r["colour"] != "deny" for r in fc)


def _node_of(fn, *tensors):
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="fake")(*tensors)
    return next(n for n in gm.graph.nodes if n.op == "call_function" and dense_ops.is_dense(n))


def test_a_large_product_is_timed_on_a_slice_of_its_batch_with_its_layouts(monkeypatch):
    """A (4096, 1024) x (1024, 2048) product (8.6e9 multiply-adds) is timed on about
    MAX_MACS of its rows, its weight transposed as in the step; the key is the whole op's."""
    x, w = torch.randn(4096, 1024), torch.randn(2048, 1024)
    node = _node_of(lambda x, w: torch.ops.aten.mm.default(x, w.t()), x, w)
    key = dense_ops.dense_timing(node, SpeedCheck(training=True)).key
    assert key[1] == (((4096, 1024), (0, 1)), ((1024, 2048), (1, 0)))
    seen = []

    def spy(a, b):  # the product, seeing what it is given
        seen.append((a.shape, b.shape, b.stride(), a.dtype, a.requires_grad))
        return a @ b

    monkeypatch.setitem(dense_ops._DENSE, spy, dense_ops._DENSE[torch.ops.aten.mm.default])
    node.target = spy
    run = dense_ops.dense_timing(node, SpeedCheck(training=True)).run
    assert 0 < run("fp32", torch.bfloat16) < math.inf
    rows = 4096 * dense_ops.MAX_MACS // (4096 * 1024 * 2048)
    assert seen == [((rows, 1024), (1024, 2048), (1, 1024), torch.float32, True)]
    run("low", torch.bfloat16)
    assert seen[-1][3] == torch.bfloat16


@pytest.mark.parametrize("training", [True, False])
def test_a_convolution_is_timed_in_both_precisions_on_real_kernels(training):
    x, w, b = torch.randn(2, 8, 32, 32), torch.randn(16, 8, 3, 3), torch.randn(16)
    conv = torch.ops.aten.convolution.default
    node = _node_of(
        lambda x, w, b: conv(x, w, b, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), x, w, b
    )
    key, run, _ = dense_ops.dense_timing(node, SpeedCheck(training=training))
    assert key[0] == "aten.convolution.default" and key[-1] is training
    assert all(0 < run(form, torch.bfloat16) < math.inf for form in ("low", "fp32"))


def test_small_products_are_not_timed():
    x, w = torch.randn(8, 64), torch.randn(64, 64)
    assert dense_ops.dense_timing(_node_of(torch.mm, x, w), SpeedCheck(True)) is None


@pytest.mark.parametrize("low, fp32, runs", [(100.0, 1.0, 4), (1.0, 100.0, 4), (1.0, 1.1, 12)])
def test_a_decisive_first_run_ends_the_timing(low, fp32, runs):
    """One form DECISIVE times faster after a run of each: no more runs (the slow kernel on
    a CPU without its instructions costs the build seconds a run); a close call: all runs."""
    calls = []

    def run(form, dtype):
        calls.append(form)
        return {"low": low, "fp32": fp32}[form] / 1e3

    ms = speed._time_forms(speed._Timed(("k",), run), torch.bfloat16)
    assert len(calls) == runs and ms == {"low": low, "fp32": fp32}


def test_real_timings_of_products_decide_as_recorded():
    """On this machine's real kernels: each timed op runs fp32 exactly where its recorded
    fp32 time was at most 1 / MARGIN of its low-precision time."""
    speed._TIMINGS.clear()
    _, _, g = _wide_graph()
    g(*_wide_batch())
    record = json.load(open(speed._record_path()))
    found = {"conv": "convolution", "fc1": "(3136, 256)", "fc2": "(256, 512)"}
    assert len(record) == len(found)
    rows = {r["module"].removeprefix("model."): r for r in _rows_of(g, DENSE)}
    for module, text in found.items():
        ((low, fp32),) = [ms for key, ms in record.items() if text in key]
        assert 0 < low < math.inf and 0 < fp32 < math.inf
        assert (rows[module]["colour"] == "deny") == (fp32 * speed.MARGIN <= low)
    assert rows["head"]["colour"] == "allow"
