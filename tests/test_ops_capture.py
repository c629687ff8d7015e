"""Ops the capture could not run, or ran wrong, against eager PyTorch.

- ``F.ctc_loss``: torch gives its aten op no fake kernel (an output sized by the longest
  target); captured as graphamp's op with padded shapes, bitwise equal to eager.
- Ops with effect tokens (``torch.linalg.solve``, ``inv``, ``cholesky``, ``eigh``: their error
  checks): train as eager, and a singular matrix raises as in eager with the step undone.
- ``F.rrelu`` in training: its backward reads the slopes its forward draws; gradients equal
  eager's for the same slopes (plain, in place, checkpointed by torch or by graphamp).
- An op fake tensors cannot run is named as such, not as a host read.
- ``F.gaussian_nll_loss`` (``nn.GaussianNLLLoss``): its check of the variance's values is a
  host read; captured without it, equal to eager in value and gradient on every variance shape.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_state_close, autocast_loss, eager_step, make_graph

import graphamp
from graphamp import CaptureError

# -- CTC -----------------------------------------------------------------------------------------

T, B, C, S = 12, 3, 6, 4


def _acoustic_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, C))


def _ctc_batches(n=3):
    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(T, B, 5, generator=gen),
            torch.randint(1, C, (B, S), generator=gen),
            torch.tensor([12, 10, 11]),
            torch.tensor([4, 2, 3]),
        )
        for _ in range(n)
    ]


def _padded(lp, targets, il, tl):
    return F.ctc_loss(lp, targets, il, tl)


def _concatenated_sum(lp, targets, il, tl):
    flat = torch.cat([targets[0, :2], targets[1, :2], targets[2, :2]])
    return F.ctc_loss(lp, flat, il, torch.tensor([2, 2, 2]), reduction="sum", zero_infinity=True)


def _module_none(lp, targets, il, tl):
    return nn.CTCLoss(reduction="none", zero_infinity=True)(lp, targets, il, tl).sum()


def _unbatched(lp, targets, il, tl):
    return F.ctc_loss(lp[:, 0], targets[0], il[0], tl[0])


def _python_lengths(lp, targets, il, tl):
    return torch.ctc_loss(lp, targets, [12, 10, 11], [4, 2, 3], 0, 1, False)


CTC_FORMS = [_padded, _concatenated_sum, _module_none, _unbatched, _python_lengths]


class CtcGraph(graphamp.Graph):
    def __init__(self, model, opt, form, **amp):
        super().__init__()
        self.model, self.form = model, form
        self.add_optimizer(opt)
        self.config.set_backend("aot_eager")
        if amp:
            self.config.enable_amp(True, dtype=amp["dtype"])
            self.set_grad_scaler(graphamp.GradScaler(init_scale=256.0))

    def build(self, x, targets, il, tl):
        loss = self.form(self.model(x).log_softmax(-1), targets, il, tl)
        loss.backward()
        return loss


@pytest.mark.parametrize("form", CTC_FORMS, ids=lambda f: f.__name__.strip("_"))
def test_ctc_loss_trains_bitwise_like_eager(form):
    model = _acoustic_model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    g = CtcGraph(model, opt, form)
    for batch in _ctc_batches():
        loss = g(*batch)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = form(ref(batch[0]).log_softmax(-1), *batch[1:])
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(loss, ref_loss.detach())
    assert_state_close(model, ref, rtol=0, atol=0)


def test_ctc_loss_under_fp16_runs_in_fp32_like_autocast():
    model = _acoustic_model()
    ref = copy.deepcopy(model)
    g = CtcGraph(model, torch.optim.SGD(model.parameters(), lr=1.0), _padded, dtype=torch.float16)
    batch = _ctc_batches(1)[0]
    loss = g(*batch)
    ref_loss = autocast_loss(
        lambda: _padded(ref(batch[0]).log_softmax(-1), *batch[1:]), torch.float16
    )
    assert abs(loss.item() - ref_loss.item()) <= 3e-2 * ref_loss.item()
    rows = [r for r in g.precision_report().rows if "ctc" in r["op"]]
    assert rows and all(r["dtype"] == "float32" for r in rows), rows


def test_wav2vec2_with_ctc_on_masked_labels_trains_like_eager():
    """A real acoustic model (transformers' Wav2Vec2ForCTC from a tiny config, SpecAugment off)
    with CTC on labels padded with -100: the targets come from masked_select (a data-dependent
    length) and the lengths from the mask; the log_alpha bound follows from that length."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        vocab_size=12,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=(8, 8),
        conv_stride=(4, 2),
        conv_kernel=(8, 4),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        mask_time_prob=0.0,
        layerdrop=0.0,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
    )
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(config).train()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def loss_of(m, x, labels):
        logits = m(input_values=x).logits
        frames = torch.full((x.shape[0],), logits.shape[1], dtype=torch.long)
        valid = labels >= 0
        return F.ctc_loss(
            logits.log_softmax(-1).transpose(0, 1),
            labels.masked_select(valid),
            frames,
            valid.sum(-1),
            zero_infinity=True,
        )

    def build(self, x, labels):
        loss = loss_of(self.model, x, labels)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(2, 400, generator=gen)
        labels = torch.randint(1, 12, (2, 5), generator=gen)
        labels[1, 3:] = -100
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = g(x, labels)
            ref_opt.zero_grad(set_to_none=True)
            ref_loss = loss_of(ref, x, labels)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert_state_close(model, ref, rtol=1e-4, atol=1e-6)


# -- ops with effect tokens: linalg error checks ---------------------------------------------------


def _linalg_loss(model, a, y):
    h = model(y)
    return (
        torch.linalg.solve(a, h).pow(2).mean()
        + torch.linalg.inv(a + h).sum()
        + torch.linalg.cholesky(a @ a.T + torch.eye(8)).diagonal().sum()
        + torch.linalg.eigh(a + a.T)[0].sum()
        + torch.inverse(a).trace()
    )


def _linalg_graph(model, opt, backend="aot_eager"):
    def build(self, a, y):
        loss = _linalg_loss(self.model, a, y)
        loss.backward()
        return loss

    return make_graph(model, None, opt, build=build, backend=backend)


def test_linalg_ops_with_error_checks_train_like_eager():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, ref))
    g = _linalg_graph(model, opt)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        a = torch.randn(8, 8, generator=gen) + 4 * torch.eye(8)
        y = torch.randn(8, 8, generator=gen)
        loss = g(a, y)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = _linalg_loss(ref, a, y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)
    assert_state_close(model, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)]
)
def test_a_singular_matrix_raises_as_in_eager_and_the_step_is_undone(backend):
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = _linalg_graph(model, opt, backend)
    y = torch.randn(8, 8)
    g(torch.randn(8, 8) + 4 * torch.eye(8), y)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        _linalg_loss(copy.deepcopy(model), torch.zeros(8, 8), y)  # eager raises
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        g(torch.zeros(8, 8), y)
    assert g.step_count == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# -- rrelu: a backward that reads what the forward drew ---------------------------------------------


class RReLUNet(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.act = nn.RReLU(0.1, 0.4)
        self.head = nn.Linear(8, 1)
        self.how = how

    def forward(self, x):
        h = self.lin(x)
        if self.how == "torch checkpoint":
            a = torch.utils.checkpoint.checkpoint(self.act, h, use_reentrant=False)
        elif self.how == "in place":
            a = F.rrelu(h.clone(), 0.1, 0.4, training=True, inplace=True)
        elif self.how == "torch.rrelu":
            a = torch.rrelu(h, 0.1, 0.4, True)
        else:
            a = self.act(h)
        return h, a, self.head(a).pow(2).mean()


@pytest.mark.parametrize(
    "how", ["module", "in place", "torch.rrelu", "torch checkpoint", "graphamp checkpointing"]
)
def test_rrelu_gradients_read_the_slopes_its_forward_drew(how):
    """The slopes are random (torch's generator, new each step): read them from the step's
    output, then eager's gradients for those slopes are what the step applied (SGD, lr 1)."""
    torch.manual_seed(0)
    model = RReLUNet(how)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    def build(self, x, _):
        h, a, loss = self.model(x)
        loss.backward()
        return h, a, loss

    configure = (
        (lambda g: g.config.enable_activation_checkpointing(nn.RReLU))
        if how == "graphamp checkpointing"
        else None
    )
    g = make_graph(model, None, opt, build=build, configure=configure)
    masks = []
    for x in torch.randn(3, 16, 6).unbind():
        h, a, loss = g(x, None)
        slopes = torch.where(h <= 0, a / h, torch.ones_like(h))
        negative = slopes[h <= 0]
        assert ((negative >= 0.1 - 1e-6) & (negative <= 0.4 + 1e-6)).all()
        masks.append(slopes)
        for p in ref.parameters():
            p.grad = None
        ref_loss = ref.head(ref.lin(x) * slopes).pow(2).mean()
        ref_loss.backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= p.grad
        torch.testing.assert_close(loss, ref_loss.detach())
        assert_state_close(model, ref, rtol=1e-5, atol=1e-6)
    assert not torch.equal(masks[0], masks[1])


class OneSlopeRReLU(nn.Module):
    """RReLU whose range is one value (lower == upper), called each way torch offers."""

    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.act = nn.RReLU(0.2, 0.2)
        self.head = nn.Linear(8, 1)
        self.how = how

    def forward(self, x):
        h = self.lin(x)
        if self.how == "in place":
            a = F.rrelu(h.clone(), 0.2, 0.2, training=True, inplace=True)
        elif self.how == "torch.rrelu":
            a = torch.rrelu(h, 0.2, 0.2, True)
        else:
            a = self.act(h)
        return self.head(a).pow(2).mean()


@pytest.mark.parametrize("how", ["module", "in place", "torch.rrelu"])
def test_rrelu_with_one_slope_trains_as_eager(how):
    """Issue 35: nn.RReLU(lower, upper) with lower == upper in training made the parameters
    NaN from the second step; every slope is that value, so the step equals eager's."""
    torch.manual_seed(0)
    model = OneSlopeRReLU(how)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    g = make_graph(model, lambda loss, _: loss, opt)
    for x in torch.randn(4, 16, 6).unbind():
        got = g(x, None)
        twin_opt.zero_grad()
        want = twin(x)
        want.backward()
        twin_opt.step()
        torch.testing.assert_close(got, want.detach())
    assert_state_close(model, twin, rtol=1e-5, atol=1e-6)


def test_rrelu_is_the_only_functional_variant_whose_backward_reads_a_filled_input():
    """Functionalization replaces an op that fills one of its inputs by the op's
    ``*_functional`` variant; where autograd's formula for the variant reads the filled input
    (rrelu's noise), the backward reads what the caller passed in, not what the forward drew.
    The other variants were audited: batch norm's two (their backward reads the mean and invstd
    they return, not the running statistics they update), the fused observer + fake-quantize
    of quantization-aware training (its backward reads the mask it returns: checked, the input
    gradient is the mask) and ``normal_functional`` (no gradient). A torch that adds a variant
    fails here, so that it gets audited too. Every registered operator is listed, loaded or
    not (``dir(torch.ops.aten)`` shows only those loaded so far)."""
    variants = {
        name
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::") and name.endswith("_functional")
    }
    assert variants == {
        "aten::_batch_norm_with_update_functional",
        "aten::_fused_moving_avg_obs_fq_helper_functional",
        "aten::_native_batch_norm_legit_functional",
        "aten::normal_functional",
        "aten::rrelu_with_noise_functional",
    }


def test_rrelu_in_eval_mode_is_torchs():
    torch.manual_seed(0)
    model = RReLUNet("module").eval()
    ref = copy.deepcopy(model)

    class Eval(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.config.set_backend("aot_eager")

        def build(self, x):
            return self.model(x)[1]

    x = torch.randn(16, 6)
    torch.testing.assert_close(Eval()(x), ref(x)[1].detach())


# -- an op fake tensors cannot run ---------------------------------------------------------------


def test_an_op_whose_output_shape_depends_on_values_is_named_not_a_host_read():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, y):
        loss = (self.model(x) * F.one_hot(y).sum(0)[:4]).sum()
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    with pytest.raises(CaptureError, match=r"torch\.nn\.functional\.one_hot") as info:
        g(torch.randn(3, 4), torch.tensor([0, 3, 1]))
    message = str(info.value)
    assert "fake tensors cannot run" in message and "num_classes" in message
    assert "torch.where" not in message and "value of a tensor in Python" not in message


# -- Gaussian negative log likelihood -------------------------------------------------------------


@pytest.mark.parametrize(
    "var_shape, full, reduction",
    [((8, 3), False, "mean"), ((8,), True, "sum"), ((8, 1), False, "none"), ((1, 3), True, "mean")],
)
def test_gaussian_nll_loss_form_equals_torchs(var_shape, full, reduction):
    """graphamp's form of the loss against torch's, forward and gradients, with a variance
    below eps (clamped, its gradient passed through as torch passes it)."""
    from graphamp.capture.op_forms import gaussian_nll_loss

    gen = torch.Generator().manual_seed(0)
    mean, target = torch.randn(8, 3, generator=gen), torch.randn(8, 3, generator=gen)
    var = torch.rand(var_shape, generator=gen) + 0.1
    var.view(-1)[0] = 1e-9
    outs = []
    for fn in (F.gaussian_nll_loss, gaussian_nll_loss):
        m, v = mean.clone().requires_grad_(), var.clone().requires_grad_()
        loss = fn(m, target, v, full=full, reduction=reduction)
        loss.sum().backward()
        outs.append((loss, m.grad, v.grad))
    for ours, theirs in zip(outs[1], outs[0]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_gaussian_nll_loss_trains_as_eager():
    """nn.GaussianNLLLoss with a predicted variance: captured (its variance check reads values,
    which failed the capture), trained as eager."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    twin = copy.deepcopy(model)
    criterion = nn.GaussianNLLLoss()

    def loss_fn(out, y):  # the mean and the log of the variance, predicted
        return criterion(out[:, :1], y, out[:, 1:].exp())

    opt, eager_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    g = make_graph(model, loss_fn, opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        ours = g(x, y)
        theirs = eager_step(twin, loss_fn, eager_opt, x, y)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_loss_whose_traced_graph_drops_its_edge_to_a_parameter_gives_eagers_zero_gradient():
    """``matrix_power(w, 0)`` is an identity copied: eager's autograd keeps an edge to ``w``
    and gives it a zero gradient, so weight decay and momentum move it; the traced graph has no
    edge (assembly failed with graphamp's own-failure message). Trained as eager."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 3))
    model = nn.ParameterList([w])
    twin = copy.deepcopy(model)

    def loss_of(m, x):
        return (torch.linalg.matrix_power(m[0], 0).sum() * x).square().sum()

    def build(g, x, y):
        loss = loss_of(g.model, x)
        loss.backward()
        return loss

    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.1, momentum=0.9)  # noqa: E731
    opt, eager_opt = make(model), make(twin)
    g = make_graph(model, None, opt, build=build)
    start = w.detach().clone()
    for _ in range(3):
        x = torch.randn(4)
        ours = g(x, x)
        eager_opt.zero_grad()
        theirs = loss_of(twin, x)
        theirs.backward()
        eager_opt.step()
        torch.testing.assert_close(ours, theirs.detach())
    torch.testing.assert_close(model[0], twin[0], rtol=0, atol=0)
    assert not torch.equal(model[0], start)  # its zero gradient: weight decay and momentum
