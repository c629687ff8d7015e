"""graphamp's precision decisions against torch.autocast, its numerics, and the user's control."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from helpers import autocast_loss, make_graph
from models import ManualAttentionBlock, SmallCNN, TinyGPT, lm_loss, seed_mlp

import graphamp
from graphamp import ConfigError
from graphamp.capture import BuildRoot, autocast_forward, capture_forward
from graphamp.inspect.compare import compare
from graphamp.passes import DEFAULT_LISTS, AmpContext, run_amp_passes
from graphamp.records.inputs import flatten_inputs
from graphamp.torchkit.fxutil import copy_graph_module

CUDA = torch.device("cuda")  # fake CUDA tensors: autocast's CUDA policy, measured on any machine


def _case(name):
    torch.manual_seed(0)
    if name == "mlp":
        return seed_mlp(), nn.CrossEntropyLoss(), torch.randn(8, 256), torch.randint(0, 10, (8,))
    if name == "cnn":
        return (
            SmallCNN(),
            nn.CrossEntropyLoss(),
            torch.randn(4, 3, 16, 16),
            torch.randint(0, 10, (4,)),
        )
    block = ManualAttentionBlock if name == "gpt_manual" else None
    model = TinyGPT(block=block) if block else TinyGPT()
    idx = torch.randint(0, 64, (2, 17))
    return model, lm_loss, idx[:, :-1], idx[:, 1:]


def _graphamp_vs_autocast(name, dtype):
    model, loss_fn, x, y = _case(name)

    def build(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    root = BuildRoot({"model": model}, build)
    inputs = flatten_inputs((x, y), {})
    cap = capture_forward(root, inputs, name, device=CUDA)
    params = frozenset(n.name for n in list(cap.gm.graph.nodes)[: len(cap.param_names)])
    ctx = AmpContext(lists=DEFAULT_LISTS, dtype=dtype, parameters=params)
    forward = run_amp_passes(copy_graph_module(cap.gm), ctx)
    trace = autocast_forward(root, inputs, dtype, device=CUDA)
    return compare(forward, trace), ctx, trace


def _documented(diff) -> str | None:
    """Which documented, deliberate difference from torch.autocast explains ``diff`` (lists.py)."""
    if (
        diff.op == "aten._log_softmax"
        and diff.module.endswith("CrossEntropyLoss>")
        or diff.op == "aten._log_softmax"
        and diff.module == ""
    ):
        # cross_entropy passes the logits' dtype to log_softmax explicitly, which autocast's
        # fp32_set_opt_dtype policy respects: it runs in fp16 there, fp32 here.
        return "cross_entropy log_softmax in fp32"
    if (
        not diff.graphamp_low
        and diff.autocast_low
        and "not between low-precision ops" in diff.reason
    ):
        return "infer/clear op feeding only fp32 ops runs fp32"
    if diff.op in ("aten.var", "aten.var_mean", "aten.std") and not diff.graphamp_low:
        return "variance in fp32"
    return None


CASES = ["mlp", "cnn", "gpt", "gpt_manual"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", CASES)
def test_precision_matches_autocast_except_documented_differences(name, dtype):
    cmp, _, _ = _graphamp_vs_autocast(name, dtype)
    assert not cmp.unmatched_graphamp and not cmp.unmatched_autocast
    assert len(cmp.pairs) > 5
    undocumented = [d for d in cmp.differences if _documented(d) is None]
    assert not undocumented, [(d.op, d.module, d.graphamp_low, d.reason) for d in undocumented]
    if name in ("mlp", "cnn", "gpt"):
        # the only difference on these: cross_entropy's log_softmax
        assert {_documented(d) for d in cmp.differences} == {"cross_entropy log_softmax in fp32"}


@pytest.mark.parametrize("name", CASES)
def test_never_more_casts_than_autocast(name):
    cmp, ctx, trace = _graphamp_vs_autocast(name, torch.float16)
    assert cmp.graphamp_casts <= trace.casts
    # even counting the parameter copies the optimizer keeps as casts
    assert ctx.stats["casts_with_parameters"] <= trace.casts


def test_strictly_fewer_casts_on_the_cnn_and_the_gpt_block():
    cnn, cnn_ctx, cnn_trace = _graphamp_vs_autocast("cnn", torch.float16)
    gpt, gpt_ctx, gpt_trace = _graphamp_vs_autocast("gpt", torch.float16)
    # forward casts: parameters arrive already cast (OneFlow's fused model-update cast)
    assert (cnn.graphamp_casts, cnn_trace.casts) == (2, 6)
    assert gpt.graphamp_casts < gpt_trace.casts
    # with parameter copies counted, the GPT block still saves casts: the LayerNorm output feeds
    # the q, k and v projections; autocast casts it once per projection, graphamp once
    assert gpt_ctx.stats["casts_with_parameters"] == gpt_trace.casts - 2 * 2  # 2 blocks


# -- numerics against eager torch.autocast ------------------------------------------------------


def _grads_by_sgd(graph_factory, model):
    """Gradients as graphamp applied them: SGD lr 1, no momentum, so grad = before - after."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = graph_factory()
    return loss, {n: before[n] - p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float16, 2e-2), (torch.bfloat16, 6e-2)], ids=["fp16", "bf16"]
)
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_loss_and_gradients_agree_with_eager_autocast(name, dtype, tol):
    model, loss_fn, x, y = _case(name)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    g = make_graph(
        model,
        loss_fn,
        opt,
        amp=dtype,
        scaler=graphamp.GradScaler(init_scale=1024.0) if dtype == torch.float16 else None,
    )
    loss, grads = _grads_by_sgd(lambda: g(x, y), model)

    ref_loss = autocast_loss(lambda: loss_fn(ref(x), y), dtype)
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    for n, p in ref.named_parameters():
        if p.grad is None or p.grad.norm() == 0:
            continue
        err = (grads[n] - p.grad).norm() / p.grad.norm()
        assert err < tol * 5, (n, float(err))


# -- user control ------------------------------------------------------------------------------


def _colour_of(g, op, module=None):
    rows = g.precision_report(with_autocast=False).rows
    hits = [r for r in rows if r["op"] == op and (module is None or r["module"] == module)]
    assert hits, (op, module)
    return {r["colour"] for r in hits}


def _small_gpt_graph(configure=None, dtype=torch.float16):
    model = TinyGPT()
    g = make_graph(
        model,
        lm_loss,
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=dtype,
        scaler=graphamp.GradScaler(),
        configure=configure,
    )
    idx = torch.randint(0, 64, (2, 17))
    g(idx[:, :-1], idx[:, 1:])
    return g


def test_list_overrides_move_ops_between_lists():
    g = _small_gpt_graph(
        lambda self: self.config.override_amp_lists(
            deny=[torch.ops.aten.gelu], infer=["aten.native_layer_norm"]
        )
    )
    assert _colour_of(g, "aten.gelu") == {"deny"}
    rows = g.precision_report(with_autocast=False).rows
    ln = [r for r in rows if r["op"] == "aten.native_layer_norm"]
    assert all(r["list"] == "infer" for r in ln)
    # as infer, the LayerNorms between blocks now sit between low-precision ops (OneFlow's choice)
    assert any(r["colour"] == "allow" and "between low-precision ops" in r["why"] for r in ln)


def test_pin_fp32_by_type_and_by_name():
    g = _small_gpt_graph(lambda self: self.config.pin_fp32(nn.Embedding, "model.head"))
    assert _colour_of(g, "aten.mm", "model.head") == {"deny"}
    rows = g.precision_report(with_autocast=False).rows
    assert all(r["colour"] == "deny" for r in rows if r["module"].startswith("model.w"))
    assert "allow" in _colour_of(g, "aten.addmm", "model.blocks.0.q")


def test_hints_inside_model_code():
    class Hinted(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            h = graphamp.full_precision(self.a(x))  # keep this activation fp32
            return self.b(torch.tanh(h))

    model = Hinted()
    g = make_graph(
        model,
        nn.functional.mse_loss,
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.bfloat16,
    )
    g(torch.randn(4, 8), torch.randn(4, 8))
    assert _colour_of(g, "aten.tanh") == {"deny"}
    # in eager mode the hint is an identity
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), model.b(torch.tanh(model.a(x))))


@pytest.mark.parametrize(
    "level, gelu, layer_norm",
    [("O1", "allow", "deny"), ("O2", "allow", "deny"), ("O3", "allow", "allow")],
)
def test_opt_levels(level, gelu, layer_norm):
    g = _small_gpt_graph(lambda self: self.config.set_amp_opt_level(level))
    assert _colour_of(g, "aten.gelu") == {gelu}
    assert _colour_of(g, "aten.native_layer_norm") == {layer_norm}


def test_opt_level_o0_is_fp32():
    with pytest.warns(UserWarning, match="loss scaling is unnecessary"):
        g = _small_gpt_graph(lambda self: self.config.set_amp_opt_level("O0"))
    assert g.compiled_steps[-1].amp_dtype is None
    assert {r["colour"] for r in g.precision_report().rows} == {"fp32"}


def test_batchnorm_statistics_and_parameters_stay_fp32():
    model = SmallCNN()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.float16,
        scaler=graphamp.GradScaler(),
    )
    g(torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    bn = model.features[1]
    assert bn.weight.dtype == bn.running_mean.dtype == torch.float32
    rows = [r for r in g.precision_report(with_autocast=False).rows if "batch_norm" in r["op"]]
    assert rows and all(r["colour"] == "allow" for r in rows)
    forward = g.compiled_steps[-1].forward_graph
    for node in forward.graph.nodes:
        if "batch_norm" in str(node.target):
            assert not any(
                a.meta.get("amp_cast") or a.meta.get("shadow_of")
                for a in node.args[1:5]
                if hasattr(a, "meta")
            )


def test_precision_report_rows_and_autocast_counts():
    g = _small_gpt_graph()
    report = g.precision_report()
    assert set(report.rows[0]) == {
        "node",
        "op",
        "module",
        "source",
        "list",
        "colour",
        "dtype",
        "why",
        "recomputed",
    }
    addmm = next(r for r in report.rows if r["op"] == "aten.addmm")
    assert addmm["dtype"] == "float16" and addmm["source"].startswith("models.py:")
    assert report.autocast is not None and report.autocast["casts"] > 0
    text = report.summary()
    assert "casts" in text and "torch.autocast on the same forward" in text
    assert (
        report.to_csv().splitlines()[0] == "node,op,module,source,list,colour,dtype,why,recomputed"
    )


# -- bad input ----------------------------------------------------------------------------------


def test_override_naming_an_op_that_does_not_exist():
    g = make_graph(seed_mlp(), nn.CrossEntropyLoss(), None)
    with pytest.raises(ConfigError, match=r"no such op 'aten\.gleu'"):
        g.config.override_amp_lists(deny=["aten.gleu"])


def test_pin_naming_a_module_that_does_not_exist():
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.bfloat16,
        configure=lambda self: self.config.pin_fp32("model.9"),
    )
    with pytest.raises(ConfigError, match=r"pin_fp32\('model\.9'\): no registered module"):
        g(torch.randn(2, 256), torch.randint(0, 10, (2,)))


def test_pin_of_a_non_module():
    g = make_graph(seed_mlp(), nn.CrossEntropyLoss(), None)
    with pytest.raises(
        ConfigError, match="nn.Module classes, qualified module names or graphamp.AmpPin"
    ):
        g.config.pin_fp32(42)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, "fp16"])
def test_non_float_or_full_precision_amp_dtype(dtype):
    g = make_graph(seed_mlp(), nn.CrossEntropyLoss(), None)
    with pytest.raises(ConfigError, match="float16 or torch.bfloat16"):
        g.config.enable_amp(True, dtype=dtype)


def test_scaler_warnings():
    model = seed_mlp()
    x, y = torch.randn(2, 256), torch.randint(0, 10, (2,))
    with pytest.warns(UserWarning, match="fp16 AMP without a grad scaler"):
        make_graph(
            model,
            nn.CrossEntropyLoss(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            amp=torch.float16,
        )(x, y)
    with pytest.warns(UserWarning, match="loss scaling is unnecessary"):
        make_graph(
            model,
            nn.CrossEntropyLoss(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            amp=torch.bfloat16,
            scaler=graphamp.GradScaler(),
        )(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_graph(
            model,
            nn.CrossEntropyLoss(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            amp=torch.float16,
            scaler=graphamp.GradScaler(),
        )(x, y)


# -- widening, and recurrent models ---------------------------------------------------


def _eval_graph(build, dtype):
    class Eval(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.config.enable_amp(True, dtype=dtype)
            self.config.set_backend("aot_eager")

        def build(self, *args):
            return build(*args)

    return Eval()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_deny_ops_widen_fp16_inputs_so_reductions_do_not_overflow(dtype):
    x = torch.full((8192,), 10.0, dtype=torch.float16)
    # the sum (81,920) overflows fp16; computed in fp32 as under autocast, the mean is exact,
    # and both are returned in fp32 as autocast returns its fp32 ops' results (CUDA autocast:
    # sum is on its fp32 list), not cast back to the fp16 they were captured in
    mean = _eval_graph(lambda x: torch.sum(x) / x.numel(), dtype)(x)
    assert mean.dtype == torch.float32 and mean.item() == 10.0
    total = _eval_graph(lambda x: x.sum(), dtype)(x)
    assert total.dtype == torch.float32 and total.item() == 81920.0
    assert torch.isinf(x.sum())  # eager fp16 (no autocast) overflows
    halved = _eval_graph(lambda x: x * 0.5, dtype)(x)  # not widened: the captured dtype
    assert halved.dtype == torch.float16
    a, b = torch.full((64,), 300.0, dtype=torch.float16), torch.zeros(64, dtype=torch.float16)
    rms = _eval_graph(lambda a, b: torch.sqrt(nn.functional.mse_loss(a, b)), dtype)(a, b)
    assert rms.item() == 300.0  # the squared error 90,000 is out of fp16's range


class MaskedScores(nn.Module):
    """DeBERTa's attention mask: ``masked_fill`` with the smallest value of the query's dtype.
    Capture runs in fp32, so the value is fp32's, which neither low dtype holds."""

    def __init__(self, dim=32):
        super().__init__()
        self.q, self.k, self.head = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, 4)

    def forward(self, x, mask):
        q, k = self.q(x), self.k(x)
        scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, torch.finfo(q.dtype).min)
        return self.head(scores.softmax(-1) @ x).mean(1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_an_op_whose_scalar_the_low_dtype_cannot_hold_stays_fp32(dtype):
    torch.manual_seed(0)
    model = MaskedScores()
    ref = copy.deepcopy(model)
    x, y = torch.randn(2, 8, 32), torch.randint(0, 4, (2,))
    mask = torch.ones(2, 8, 8, dtype=torch.bool).tril()

    def build(g, x, y):
        loss = nn.functional.cross_entropy(g.model(x, mask), y)
        loss.backward()
        return loss

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = graphamp.GradScaler() if dtype == torch.float16 else None
    g = make_graph(model, None, opt, amp=dtype, scaler=scaler, build=build)
    loss = g(x, y)  # in low precision the fill raised: -3.4e38 is beyond fp16 and bf16
    ref_loss = autocast_loss(lambda: nn.functional.cross_entropy(ref(x, mask), y), dtype)
    assert abs(loss.item() - ref_loss.item()) <= 2e-2 * abs(ref_loss.item())
    fill = next(r for r in g.precision_report().rows if r["op"] == "aten.masked_fill")
    assert fill["dtype"] == "float32" and "-3.403e+38 is beyond" in fill["why"], fill
    matmuls = [r for r in g.precision_report().rows if r["op"] in ("aten.bmm", "aten.addmm")]
    assert matmuls and all(r["dtype"] == str(dtype)[6:] for r in matmuls)


def test_only_number_arguments_beyond_the_low_dtype_keep_an_op_fp32():
    # 1e5 is beyond fp16 (65,504) but within bf16; a size of 70,000 is not a number argument
    scaled = _eval_graph(lambda x: (x.view(70000, 1) @ torch.ones(1, 2)) * 1e5, torch.float16)
    scaled(torch.ones(70000))
    report = scaled.precision_report()
    mul = next(r for r in report.rows if r["op"] == "aten.mul")
    assert mul["dtype"] == "float32" and "1e+05 is beyond float16" in mul["why"]
    view = next(r for r in report.rows if r["op"] in ("aten.view", "aten._unsafe_view"))
    assert "beyond" not in view["why"]
    bf16 = _eval_graph(lambda x: (x.view(70000, 1) @ torch.ones(1, 2)) * 1e5, torch.bfloat16)
    bf16(torch.ones(70000))
    mul = next(r for r in bf16.precision_report().rows if r["op"] == "aten.mul")
    assert "beyond" not in mul["why"]


class RnnLM(nn.Module):
    def __init__(self, cell, vocab=50, dim=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = cell(dim, dim, num_layers=2, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        return self.head(self.rnn(self.emb(x))[0])


@pytest.mark.parametrize(
    "cell, dtype, tol",
    [
        pytest.param(nn.LSTM, torch.float16, 2e-2, id="lstm-fp16"),
        pytest.param(nn.GRU, torch.bfloat16, 6e-2, id="gru-bf16"),
        # the other two pairings repeat what these cover: the slow lane
        pytest.param(nn.LSTM, torch.bfloat16, 6e-2, id="lstm-bf16", marks=pytest.mark.slow),
        pytest.param(nn.GRU, torch.float16, 2e-2, id="gru-fp16", marks=pytest.mark.slow),
    ],
)
def test_recurrent_lm_trains_in_low_precision_with_fewer_casts_than_autocast(cell, dtype, tol):
    torch.manual_seed(0)
    model = RnnLM(cell)
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 50, (4, 13))
    x, y = idx[:, :-1], idx[:, 1:]
    g = make_graph(
        model,
        lm_loss,
        torch.optim.SGD(model.parameters(), lr=1.0),
        amp=dtype,
        scaler=graphamp.GradScaler(init_scale=1024.0) if dtype == torch.float16 else None,
    )
    loss, grads = _grads_by_sgd(lambda: g(x, y), model)
    forward = g.compiled_steps[-1].forward_graph
    rnn = [n for n in forward.graph.nodes if "graphamp.rnn" in str(n.target)]
    assert len(rnn) == 1 and rnn[0].meta["amp_colour"] == "allow"
    # against eager fp32: the low-precision layer stays within precision noise
    ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=tol, atol=tol)
    for n, p in ref.named_parameters():
        err = (grads[n] - p.grad).norm() / p.grad.norm()
        assert err < tol * 5, (n, float(err))
    # casts: graphamp's, parameter copies included, against autocast's on the same forward
    root = BuildRoot({"model": model}, lambda x, y: lm_loss(model(x), y))
    trace = autocast_forward(root, flatten_inputs((x, y), {}), dtype, device=CUDA)
    report = g.precision_report(with_autocast=False)
    assert report.casts + report.parameter_copies < trace.casts
