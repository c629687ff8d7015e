"""fp8 matmuls (config.enable_fp8): the numerics of each recipe against a reference written from
its definition, the graph's choices, training against bf16, and the refusals."""

from __future__ import annotations

import copy
import warnings

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import make_graph

import graphamp
from graphamp import ConfigError
from graphamp.torchkit.fp8_numerics import E4M3, E5M2, fp8_matmul, fp8_matmul_delayed

RECIPES = ("tensorwise", "rowwise")  # dynamic scales; the delayed recipe has its own tests


def _reference_quantized(x: torch.Tensor, dtype: torch.dtype, dim: int | None) -> torch.Tensor:
    """x after a round trip through ``dtype`` with the recipe's scale (fp32, dequantised):
    scale = the format's largest value over amax (per tensor, or per slice along ``dim``),
    values saturated, then divided back."""
    largest = torch.finfo(dtype).max
    x32 = x.float()
    amax = x32.abs().amax() if dim is None else x32.abs().amax(dim=dim, keepdim=True)
    scale = largest / amax.clamp(min=1e-12)
    return (x32 * scale).clamp(-largest, largest).to(dtype).float() / scale


def _reference(a, b, grad, recipe):
    """(out, grad_a, grad_b) from the recipe's definition: each matmul's operands quantised as
    the recipe says, multiplied in fp32."""
    if recipe == "tensorwise":
        qa, qb = _reference_quantized(a, E4M3, None), _reference_quantized(b, E4M3, None)
        qg = _reference_quantized(grad, E5M2, None)
        return qa @ qb, qg @ qb.t(), qa.t() @ qg
    out = _reference_quantized(a, E4M3, 1) @ _reference_quantized(b, E4M3, 0)
    grad_a = _reference_quantized(grad, E4M3, 1) @ _reference_quantized(b, E4M3, 1).t()
    grad_b = _reference_quantized(a, E4M3, 0).t() @ _reference_quantized(grad, E4M3, 0)
    return out, grad_a, grad_b


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_matches_its_definition_forward_and_backward(recipe):
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(48, 64, generator=gen) * 3).to(torch.bfloat16).requires_grad_()
    b = (torch.randn(64, 32, generator=gen) / 5).to(torch.bfloat16).requires_grad_()
    grad = (torch.randn(48, 32, generator=gen) * 1e-3).to(torch.bfloat16)
    out = fp8_matmul(a, b, recipe)
    out.backward(grad)
    expected = _reference(a.detach(), b.detach(), grad, recipe)
    # the fp8 products are exact in fp32; what differs is the bf16 rounding of each result
    for got, want in zip((out, a.grad, b.grad), expected):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max())
    # and the fp8 error against full precision stays within the formats' rounding
    full = a.detach().float() @ b.detach().float()
    assert (out.float() - full).norm() / full.norm() < 0.08


def test_a_zero_tensor_gets_a_finite_scale():
    a = torch.zeros(16, 16, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(16, 16).to(torch.bfloat16).requires_grad_()
    out = fp8_matmul(a, b, "tensorwise")
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out)) and torch.isfinite(b.grad).all()


def test_a_malformed_saved_history_is_refused_and_nothing_loads():
    """The fp8 component checks its part of a saved graph state with the rest, before anything
    loads: a history of the wrong rows raises ConfigError and the graph keeps its step count,
    its histories and its scale."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def setup(g):
        g.config.enable_fp8(True, recipe="delayed", history=4)

    g = make_graph(model, F.cross_entropy, opt, amp=torch.bfloat16, configure=setup)
    for seed in range(2):
        g(*_batch(seed))
    before = copy.deepcopy(g.state_dict())
    bad = copy.deepcopy(before)
    bad["step"] = 7
    name = next(iter(bad["fp8_histories"]))
    bad["fp8_histories"][name] = torch.zeros(2, 4)
    with pytest.raises(ConfigError, match="fp8_histories must map fp8 matmul names"):
        g.load_state_dict(bad)
    after = g.state_dict()
    assert after["step"] == before["step"] == 2
    assert all(
        torch.equal(after["fp8_histories"][k], v) for k, v in before["fp8_histories"].items()
    )


@pytest.mark.parametrize("recipe", [*RECIPES, "delayed"])
def test_an_inf_stays_non_finite_through_an_fp8_matmul(recipe):
    """Saturation is for finite values beyond the format (a stale delayed scale); an inf or
    NaN must still reach the step's overflow check (torch's CPU cast would saturate inf)."""
    a = torch.randn(16, 16).to(torch.bfloat16)
    a[3, 5] = float("inf")
    b = torch.randn(16, 16).to(torch.bfloat16)
    if recipe == "delayed":
        out = fp8_matmul_delayed(a, b, torch.zeros(3, 5), 0)
    else:
        out = fp8_matmul(a, b, recipe)
    assert not torch.isfinite(out[3]).all()


def _mlp(hidden=64, out=16):
    return models.mlp(32, hidden, hidden, hidden, out, act=nn.GELU, seed=0)


def _batch(seed=1):
    return models.batches(1, 64, 32, 16, seed=seed)[0]


def _fp8_graph(model, opt=None, **fp8):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
    return make_graph(
        model,
        F.cross_entropy,
        opt,
        amp=torch.bfloat16,
        configure=lambda g: g.config.enable_fp8(True, **fp8),
    )


def _colours(g) -> dict[str, str]:
    """Each matmul row of the precision report: module -> its colour (fp8 or allow)."""
    rows = g.precision_report(with_autocast=False).rows
    return {
        r["module"]: r["colour"]
        for r in rows
        if r["op"] in ("graphamp.fp8_mm", "aten.addmm", "aten.mm")
    }


def test_the_middle_layers_run_in_fp8_and_the_report_says_why_the_others_do_not():
    g = _fp8_graph(_mlp())
    g(*_batch())
    assert _colours(g) == {
        "model.0": "allow",  # first layer
        "model.2": "fp8",
        "model.4": "fp8",
        "model.6": "allow",  # last layer
    }
    report = g.precision_report(with_autocast=False)
    kept = [r for r in report.rows if r["module"] == "model.0" and r["op"] == "aten.addmm"]
    assert "input projection or output layer" in kept[0]["why"]
    assert "2 of them fp8 matmuls" in report.summary()


def test_keep_and_sizes_decide_too():
    """keep= moves a module out of fp8; a layer of 10 outputs cannot be fp8 (multiples of 16);
    keep_first_last=False lets the first layer in."""
    model = _mlp(out=10)
    g = _fp8_graph(model, keep=["model.4"], keep_first_last=False)
    g(*_batch()[0:1], torch.randint(0, 10, (64,)))
    assert _colours(g) == {
        "model.0": "fp8",
        "model.2": "fp8",
        "model.4": "allow",  # kept by the user
        "model.6": "allow",  # 10 outputs
    }
    rows = g.precision_report(with_autocast=False).rows
    why = {r["module"]: r["why"] for r in rows if r["op"] == "aten.addmm"}
    assert "kept out of fp8" in why["model.4"] and "multiples of 16" in why["model.6"]


@pytest.mark.parametrize(
    "keep, hint",
    [("4", "'model.4'"), ("model.44", "'model.4'"), ("nowhere", "")],
    ids=["relative-to-the-model", "misspelled", "nothing-near"],
)
def test_a_keep_path_that_names_no_module_is_an_error_naming_the_nearest(keep, hint):
    g = _fp8_graph(_mlp(out=10), keep=[keep])
    with pytest.raises(ConfigError, match=r"enable_fp8\(keep=\.\.\.\)") as raised:
        g(*_batch()[0:1], torch.randint(0, 10, (64,)))
    assert (f"did you mean {hint}" in str(raised.value)) == bool(hint), raised.value


def _delayed_reference(x: torch.Tensor, dtype: torch.dtype, history: list[float]) -> torch.Tensor:
    """x through ``dtype`` with Transformer Engine's delayed scale: the format's largest value
    over the largest amax of the history (1 while it holds none), dequantised."""
    amax = max(history)
    scale = torch.finfo(dtype).max / amax if amax > 0 else 1.0
    largest = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-largest, largest).to(dtype).float() / scale


def test_the_delayed_recipe_scales_from_the_history_and_records_this_step():
    """Three steps by hand: each scale comes from the history before the step (1 at first),
    each operand's amax lands in column 0, and the step's roll pushes it into the history."""
    from graphamp.torchkit.fp8_numerics import rolled_history

    gen = torch.Generator().manual_seed(0)
    state = torch.zeros(3, 1 + 4)
    for step in range(3):
        a = (torch.randn(32, 64, generator=gen) * (step + 1)).to(torch.bfloat16)
        b = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
        grad = (torch.randn(32, 48, generator=gen) * 1e-2).to(torch.bfloat16)
        before = state[:, 1:].clone()
        a.requires_grad_(), b.requires_grad_()
        out = fp8_matmul_delayed(a, b, state, 0)
        out.backward(grad)
        qa = _delayed_reference(a.detach(), E4M3, before[0].tolist())
        qb = _delayed_reference(b.detach(), E4M3, before[1].tolist())
        qg = _delayed_reference(grad, E5M2, before[2].tolist())
        for got, want in ((out, qa @ qb), (a.grad, qg @ qb.t()), (b.grad, qa.t() @ qg)):
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max())
        amaxes = [t.detach().abs().amax().float() for t in (a, b, grad)]
        assert torch.equal(state[:, 0], torch.stack(amaxes))
        state = rolled_history(state)
        assert torch.equal(state[:, 1], torch.stack(amaxes)) and torch.equal(
            state[:, 2:], before[:, :-1]
        )


def test_delayed_histories_are_step_state_untouched_by_a_skipped_step():
    """The histories fill as steps run, are in g.state_dict(), stay bitwise when a step is
    skipped (an inf batch under a scaler), and a resumed run equals the uninterrupted one."""

    def make():
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def setup(g):
            g.config.enable_fp8(True, recipe="delayed", history=4)
            g.set_grad_scaler(graphamp.GradScaler(init_scale=2.0**8))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a scaler beside bf16 is unusual: here it skips
            g = make_graph(model, F.cross_entropy, opt, amp=torch.bfloat16, configure=setup)
        return model, opt, g

    batches = [_batch(seed) for seed in range(6)]
    model, opt, g = make()
    for x, y in batches[:3]:
        g(x, y)
    histories = g.state_dict()["fp8_histories"]
    assert len(histories) == 2 and all(h.shape == (3, 4) for h in histories.values())
    assert all((h[:, :3] > 0).all() and (h[:, 3] == 0).all() for h in histories.values())
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), g.state_dict()))
    x, y = batches[3]
    poisoned = x.clone()
    poisoned[0, 0] = float("inf")
    g(poisoned, y)  # skipped
    after = g.state_dict()["fp8_histories"]
    assert all(torch.equal(after[k], histories[k]) for k in histories)
    straight = [g(x, y).detach().clone() for x, y in batches[3:]]
    model2, opt2, g2 = make()
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    g2.load_state_dict(saved[2])
    g2(poisoned, batches[3][1])  # the same skipped step
    resumed = [g2(x, y).detach().clone() for x, y in batches[3:]]
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight))
    for p, q in zip(model2.parameters(), model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("recipe", [*RECIPES, "delayed"])
def test_fp8_trains_like_bf16(recipe):
    """Twenty AdamW steps on one batch: fp8's losses follow bf16's within fp8's rounding, and
    both fall."""
    bf16_model = _mlp()
    fp8_model = copy.deepcopy(bf16_model)
    opt = torch.optim.AdamW(bf16_model.parameters(), lr=1e-3)
    bf16 = make_graph(bf16_model, F.cross_entropy, opt, amp=torch.bfloat16)
    fp8 = _fp8_graph(fp8_model, recipe=recipe)
    x, y = _batch()
    pairs = [(float(bf16(x, y)), float(fp8(x, y))) for _ in range(20)]
    for a, b in pairs:
        assert abs(a - b) <= 0.02 * a, pairs
    assert pairs[-1][1] < pairs[0][1] * 0.95


def test_a_checkpoint_resumes_bitwise():
    """Dynamic scales keep no state: a run restarted from the model's, optimizer's and graph's
    state dicts computes what the uninterrupted run does, bitwise."""
    straight_model = _mlp()
    straight = _fp8_graph(straight_model)
    batches = [_batch(seed) for seed in range(6)]
    losses = [straight(x, y).detach().clone() for x, y in batches]
    first_model = _mlp()
    first_opt = torch.optim.AdamW(first_model.parameters(), lr=1e-3)
    first = _fp8_graph(first_model, first_opt)
    for x, y in batches[:3]:
        first(x, y)
    saved = copy.deepcopy((first_model.state_dict(), first_opt.state_dict(), first.state_dict()))
    resumed_model = _mlp()
    resumed_opt = torch.optim.AdamW(resumed_model.parameters(), lr=1e-3)
    resumed = _fp8_graph(resumed_model, resumed_opt)
    resumed_model.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    resumed.load_state_dict(saved[2])
    for (x, y), expected in zip(batches[3:], losses[3:]):
        assert torch.equal(resumed(x, y), expected)
    for p, q in zip(resumed_model.parameters(), straight_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "configure, words",
    [
        (lambda g: g.config.enable_amp(True), r"bf16 AMP.*dtype=torch\.bfloat16"),
        (lambda g: None, r"bf16 AMP"),
    ],
)
def test_fp8_without_bf16_amp_is_refused_by_name(configure, words):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def setup(g):
        configure(g)
        g.config.enable_fp8(True)

    g = make_graph(model, F.cross_entropy, opt, configure=setup)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError, match=words):
        g(*_batch())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_bad_fp8_settings_fail_where_they_are_written():
    g = make_graph(_mlp(), F.cross_entropy, None)
    with pytest.raises(ConfigError, match=r"enable_fp8\(history\) must be a positive int"):
        g.config.enable_fp8(True, recipe="delayed", history=0)
    with pytest.raises(ConfigError, match="unknown enable_fp8\\(recipe 'e4m3'"):
        g.config.enable_fp8(True, recipe="e4m3")
    with pytest.raises(ConfigError, match="module paths"):
        g.config.enable_fp8(True, keep=[3])


def test_the_fp8_report_says_where_a_delayed_scale_saturated():
    """After steps on the same batch, one ten times larger exceeds the range the input's
    delayed scale was computed for: the report flags that operand of the first fp8 layer, by
    about 10x. Weights that grow a little between steps clip their largest value by less than
    e4m3 rounds it: not flagged (their factor still shows it)."""
    model = _mlp()
    g = _fp8_graph(model, recipe="delayed", keep_first_last=False)
    x, y = _batch()
    for _ in range(3):
        g(x, y)
    assert not g.fp8_report().saturated
    assert all(r.factor < 1.0625 for r in g.fp8_report().rows)
    g(x * 10, y)
    report = g.fp8_report()
    first = [r for r in report.rows if r.module == "model.0"]
    by_operand = {r.operand: r for r in first}
    assert by_operand["input"].saturated and 9 < by_operand["input"].factor < 11
    assert by_operand["weight"].factor < 1.1 and not by_operand["weight"].saturated
    assert "yes, 10.0x" in str(report)


def test_the_fp8_report_needs_the_delayed_recipe():
    g = _fp8_graph(_mlp())
    g(*_batch())
    with pytest.raises(ConfigError, match="recipe='delayed'"):
        g.fp8_report()


@pytest.mark.parametrize(
    "formats, rowwise",  # torch's rowwise kernel takes e4m3 operands only
    [((E4M3, E4M3), False), ((E5M2, E4M3), False), ((E4M3, E5M2), False), ((E4M3, E4M3), True)],
)
def test_the_cpus_fp8_product_is_torchs_kernel_but_for_the_order_of_its_sums(formats, rowwise):
    """On the CPU, fp8_numerics.scaled_mm sums the widened operands in fp32 instead of calling
    torch's CPU _scaled_mm (95 ms where this takes 0.3 ms): the same product up to the order of
    the fp32 sums, so at most a unit in the output's last place."""
    from graphamp.torchkit.fp8_numerics import scaled_mm

    gen = torch.Generator().manual_seed(1)
    a8 = (torch.randn(32, 256, generator=gen) * 3).to(formats[0])
    b8 = (torch.randn(48, 256, generator=gen) * 2).to(formats[1]).t()  # column-major
    if rowwise:
        a_inv, b_inv = (
            torch.rand(32, 1, generator=gen) + 0.1,
            torch.rand(1, 48, generator=gen) + 0.1,
        )
    else:
        a_inv, b_inv = torch.tensor(0.37), torch.tensor(1.7)
    got = scaled_mm(a8, a_inv, b8, b_inv, torch.bfloat16)
    want = torch._scaled_mm(a8, b8, scale_a=a_inv, scale_b=b_inv, out_dtype=torch.bfloat16)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)
