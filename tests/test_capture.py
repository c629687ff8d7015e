"""Capture of what real PyTorch code does, against the eager oracle.

Each case trains a few steps through graphamp and the same steps eagerly, and compares
parameters (fp32: to rounding noise; AMP: finite and close to eager autocast).
"""

from __future__ import annotations

import copy

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_state_close, autocast_loss, clone_training, make_graph

import graphamp


def _train_both(
    model,
    build_loss,
    data,
    make_opt=None,
    steps=3,
    rtol=1e-5,
    atol=1e-6,
    configure=None,
    **graph_kwargs,
):
    """Train ``model`` through a Graph and a deepcopy eagerly on the same batches; compare."""
    make_opt = make_opt or (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    ref, ref_opt, _ = clone_training(model, make_opt)
    opt = make_opt(model)

    def build(self, x, y):
        loss = build_loss(self.model, x, y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build, configure=configure, **graph_kwargs)
    for x, y in data[:steps]:
        loss = g(x, y)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = build_loss(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=rtol, atol=atol)
    assert_state_close(model, ref, rtol=rtol, atol=atol)
    return g, ref


def _batches(n=3, shape=(8, 16), classes=4, seed=0):
    return models.batches(n, shape[0], shape[1:], classes, seed=seed)


def test_detach_in_build_stops_gradients_like_eager():
    """make_fx's default turns detach into alias; a re-differentiated graph must keep the cut."""
    model = nn.Linear(16, 4)

    def loss_of(m, x, y):
        target = (m(x) * 2).detach()
        return ((m(x) - target) ** 2).mean()

    _train_both(model, loss_of, _batches())


class TwoNames(nn.Module):
    """One module reachable under two names, as public model code often does."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(4, 8, 3, padding=1)
        self.net = nn.Sequential(self.conv1, nn.ReLU(), nn.Conv1d(8, 4, 3, padding=1))

    def forward(self, x):
        return self.net(x).mean(-1)


def test_a_module_under_two_names_trains_like_eager():
    model = TwoNames()
    _train_both(model, lambda m, x, y: F.cross_entropy(m(x), y), _batches(shape=(8, 4, 10)))
    assert model.conv1 is model.net[0]


FAILING_BUILDS = {
    "item": lambda m, x, y: m(x).sum().item(),
    "python branch": lambda m, x, y: m(x).sum() if m(x).sum() > 0 else m(x).mean(),
    "in-place parameter": lambda m, x, y: m.net[2].weight.data.mul_(2),
    "raises": lambda m, x, y: (_ for _ in ()).throw(ValueError("user code raised")),
    "no backward": lambda m, x, y: m(x).sum(),
}


@pytest.mark.parametrize("name", sorted(FAILING_BUILDS))
def test_a_failed_capture_leaves_the_users_model_exactly_as_it_was(name):
    """Every parameter and buffer is the same Python object afterwards, with the same values,
    and the model works eagerly."""
    model = TwoNames()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {
        n: (id(t), t.detach().clone())
        for n, t in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
    }
    objects = [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules()]
    body = FAILING_BUILDS[name]

    def build(self, x, y):
        out = body(self.model, x, y)
        if name != "no backward" and isinstance(out, torch.Tensor):
            out.backward()
        return out

    g = make_graph(model, None, opt, build=build)
    with pytest.raises((graphamp.GraphampError, ValueError)):
        g(torch.randn(2, 4, 10), torch.randint(0, 4, (2,)))
    for module, params, buffers in objects:
        assert module._parameters == params and module._buffers == buffers
    for n, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        assert id(t) == before[n][0], n
        assert torch.equal(t.detach(), before[n][1]), n
    assert all(type(p) is nn.Parameter for p in model.parameters())
    model(torch.randn(2, 4, 10)).sum().backward()  # still an ordinary eager model


# -- custom autograd Functions -----------------------------------------------------------


class GradReverse(torch.autograd.Function):
    """DANN's gradient reversal, old style (ctx in forward), with a non-tensor argument."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class StraightThroughSign(torch.autograd.Function):
    """A straight-through estimator with setup_context and two outputs."""

    @staticmethod
    def forward(x, scale):
        return torch.sign(x) * scale, x.abs().mean()

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, scale = inputs
        ctx.save_for_backward(x)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, grad, grad_mean):
        (x,) = ctx.saved_tensors
        return grad * ctx.scale * (x.abs() <= 1).to(
            grad.dtype
        ) + grad_mean * x.sign() / x.numel(), None


class WithCustomFunctions(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.domain = nn.Linear(32, 2)

    def forward(self, x):
        h = torch.relu(self.features(x))
        q, mean = StraightThroughSign.apply(h, 0.5)
        return self.head(q + mean), self.domain(GradReverse.apply(h, 0.3))


def _dann_loss(m, x, y):
    logits, domain = m(x)
    return F.cross_entropy(logits, y) + F.cross_entropy(domain, y % 2)


def test_custom_autograd_functions_train_with_their_own_backward():
    _train_both(WithCustomFunctions(), _dann_loss, _batches())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_custom_autograd_functions_under_amp_are_one_fp32_node(dtype):
    model = WithCustomFunctions()
    ref = copy.deepcopy(model)
    scaler = graphamp.GradScaler() if dtype == torch.float16 else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, y):
        loss = _dann_loss(self.model, x, y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build, amp=dtype, scaler=scaler)
    x, y = _batches(1)[0]
    loss = g(x, y)
    ref_loss = autocast_loss(lambda: _dann_loss(ref, x, y), dtype, backward=False)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    rows = [
        r
        for r in g.precision_report(with_autocast=False).rows
        if r["op"].startswith("autograd.Function")
    ]
    assert sorted(r["op"] for r in rows) == [
        "autograd.Function GradReverse",
        "autograd.Function StraightThroughSign",
    ]
    assert all(r["dtype"] == "float32" and r["list"] == "unknown" for r in rows)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_listed_autograd_function_runs_in_low_precision():
    model = WithCustomFunctions()

    def configure(self):
        self.config.override_amp_lists(infer=[GradReverse], clear=[StraightThroughSign])

    g = make_graph(
        model,
        None,
        torch.optim.SGD(model.parameters(), lr=0.1),
        build=lambda self, x, y: _backward(_dann_loss(self.model, x, y)),
        amp=torch.bfloat16,
        configure=configure,
    )
    g(*_batches(1)[0])
    rows = {r["op"]: r for r in g.precision_report(with_autocast=False).rows}
    reverse, sign = (
        rows["autograd.Function GradReverse"],
        rows["autograd.Function StraightThroughSign"],
    )
    assert (reverse["list"], sign["list"]) == ("infer", "clear")
    # both sit between the features' and the heads' matrix products: low precision
    assert reverse["dtype"] == sign["dtype"] == "bfloat16", (reverse, sign)


def _backward(loss):
    loss.backward()
    return loss


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_in_user_code_trains_like_eager(reentrant):
    import torch.utils.checkpoint as checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)
            )
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            for block in self.blocks:
                x = x + checkpoint.checkpoint(block, x, use_reentrant=reentrant)
            return self.head(x)

    def loss_of(m, x, y):
        return F.cross_entropy(m(x), y)

    model = Checkpointed()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    g = make_graph(model, None, opt, build=lambda self, x, y: _backward(loss_of(self.model, x, y)))
    for x, y in _batches():
        # reentrant checkpoint trains what it wraps only when an input requires grad (eager
        # and graphamp alike: tests/test_checkpointing.py checks the case without)
        x.requires_grad_(reentrant)
        g(x, y)
        ref_opt.zero_grad()
        loss_of(ref, x, y).backward()
        ref_opt.step()
    assert_state_close(model, ref)


# -- gradients taken inside build(): gradient penalties ---------------------------------


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1)
        )

    def forward(self, x):
        return self.net(x)


ALPHA = torch.rand(8, 1, generator=torch.Generator().manual_seed(0))


def _wgan_gp(m, real, fake):
    """WGAN-GP's critic loss: the penalty differentiates the critic with respect to its input.
    (The mixing weights are drawn outside: random draws inside a compiled step follow torch's
    global generator, not eager's sequence.)"""
    mixed = (ALPHA * real + (1 - ALPHA) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(m(mixed).sum(), mixed, create_graph=True)
    penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    return m(fake).mean() - m(real).mean() + 10.0 * penalty


def test_gradient_penalty_trains_like_eager():
    real_fake = [(torch.randn(8, 16), torch.randn(8, 16) * 2) for _ in range(3)]
    _train_both(
        Critic(),
        _wgan_gp,
        real_fake,
        make_opt=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, betas=(0.5, 0.9)),
    )


def test_gradient_penalty_with_a_scaler_follows_torchs_recipe():
    """torch's documented recipe under autocast + GradScaler: the penalty's gradients are taken
    on the scaled output and unscaled before use. graphamp does it for the user."""
    model = Critic()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    real, fake = torch.randn(8, 16), torch.randn(8, 16) * 2

    def build(self, real, fake):
        loss = _wgan_gp(self.model, real, fake)
        loss.backward()
        return loss

    g = make_graph(
        model,
        None,
        opt,
        build=build,
        amp=torch.bfloat16,
        scaler=graphamp.GradScaler(init_scale=2.0**12),
    )
    with pytest.warns(UserWarning, match="loss scaling is unnecessary"):
        loss = g(real, fake)
    # the eager recipe (https://pytorch.org/docs/stable/notes/amp_examples.html)
    mixed = (ALPHA * real + (1 - ALPHA) * fake).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ref(mixed)
    (scaled,) = torch.autograd.grad(scaler.scale(out.sum()), mixed, create_graph=True)
    grad = scaled / scaler.get_scale()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = (
            ref(fake).mean() - ref(real).mean() + 10.0 * ((grad.norm(2, dim=1) - 1) ** 2).mean()
        )
    scaler.scale(ref_loss).backward()
    scaler.step(ref_opt)
    scaler.update()
    torch.testing.assert_close(loss, ref_loss.float().detach(), rtol=2e-2, atol=2e-2)
    assert_state_close(model, ref, rtol=2e-2, atol=2e-3)
    # the penalty's gradient is computed on the scaled seed: a node multiplies by loss_scale
    forward = g.compiled_steps[-1].forward_graph
    scale = next(n for n in forward.graph.nodes if n.name == "loss_scale")
    assert {u.target for u in scale.users} >= {torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor}


# -- data-dependent shapes, plain tensors, custom ops ------------------------------------


def _masked_ce(m, x, y):
    keep = y >= 0  # a masked token loss: labels -1 are padding
    return F.cross_entropy(m(x)[keep], y[keep])


def _nonzero_ce(m, x, y):
    idx = torch.nonzero(y >= 0).squeeze(1)
    return F.cross_entropy(m(x).index_select(0, idx), y.index_select(0, idx))


def _masked_select(m, x, y):
    out = m(x)
    return torch.masked_select(out, (y >= 0).unsqueeze(1).expand_as(out)).pow(2).mean()


def _label_batches():
    gen = torch.Generator().manual_seed(1)
    labels = [[0, -1, 2, 1, -1, 0], [-1, -1, 2, 1, -1, 3], [1, 2, 3, 0, 1, -1]]
    return [(torch.randn(6, 16, generator=gen), torch.tensor(y)) for y in labels]


@pytest.mark.parametrize("loss_of", [_masked_ce, _nonzero_ce, _masked_select])
def test_data_dependent_shapes_train_like_eager(loss_of):
    """A different number of kept rows every call, one compiled step."""
    g, _ = _train_both(nn.Linear(16, 4), loss_of, _label_batches())
    assert len(g.compiled_steps) == 1


@pytest.mark.inductor
def test_data_dependent_shapes_compile_with_inductor():
    _train_both(
        nn.Linear(16, 4), _masked_ce, _label_batches(), backend="inductor", rtol=1e-4, atol=1e-5
    )


TABLE = torch.randn(16, 16)  # a module-level constant tensor, read in build()


class Lookup:
    """A helper object holding a plain tensor (neither parameter, buffer nor argument)."""

    def __init__(self):
        self.scale = torch.full((16,), 0.5)


def test_plain_tensors_read_in_build_are_live_inputs():
    helper = Lookup()
    model = nn.Linear(16, 4)

    def loss_of(m, x, y):
        return F.cross_entropy(m((x @ TABLE) * helper.scale), y)

    g, ref = _train_both(model, loss_of, _batches())
    helper.scale.mul_(3.0)  # an in-place change between calls is seen by the next one
    x, y = _batches(1, seed=5)[0]
    loss = g(x, y)
    torch.testing.assert_close(loss, loss_of(ref, x, y).detach(), rtol=1e-5, atol=1e-6)


@torch.library.custom_op("graphamp_tests::scaled_sin", mutates_args=())
def scaled_sin(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.sin(x) * scale


@scaled_sin.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _scaled_sin_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


def _scaled_sin_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * torch.cos(x) * ctx.scale, None


scaled_sin.register_autograd(_scaled_sin_backward, setup_context=_scaled_sin_context)


def test_custom_ops_with_their_own_backward_train_like_eager():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))

    def loss_of(m, x, y):
        return F.cross_entropy(m[1](scaled_sin(m[0](x), 0.5)), y)

    _train_both(model, loss_of, _batches())


def test_custom_ops_are_one_node_kept_fp32_unless_listed():
    def run(configure=None):
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
        g = make_graph(
            model,
            None,
            torch.optim.SGD(model.parameters(), lr=0.1),
            build=lambda self, x, y: _backward(
                F.cross_entropy(self.model[1](scaled_sin(self.model[0](x), 0.5)), y)
            ),
            amp=torch.bfloat16,
            configure=configure,
        )
        g(*_batches(1)[0])
        report = g.precision_report(with_autocast=False)
        (row,) = [r for r in report.rows if r["op"] == "graphamp_tests.scaled_sin"]
        return row, report

    row, report = run()
    assert (row["list"], row["dtype"]) == ("unknown", "float32")
    assert "graphamp_tests.scaled_sin" in report.unknown_ops
    row, _ = run(lambda self: self.config.override_amp_lists(infer=["graphamp_tests.scaled_sin"]))
    assert (row["list"], row["dtype"]) == ("infer", "bfloat16")


# -- common modules: EmbeddingBag, InstanceNorm, TransformerEncoder masks, sparse gradients --------


def test_embedding_bag_trains_like_eager():
    class TextClassifier(nn.Module):  # PyTorch's text-classification tutorial model
        def __init__(self):
            super().__init__()
            self.embedding = nn.EmbeddingBag(50, 16, mode="mean")
            self.fc = nn.Linear(16, 4)

        def forward(self, text, offsets):
            return self.fc(self.embedding(text, offsets))

    gen = torch.Generator().manual_seed(0)
    data = [
        (
            (torch.randint(0, 50, (20,), generator=gen), torch.tensor([0, 5, 12])),
            torch.tensor([0, 3, 1]),
        )
        for _ in range(3)
    ]
    _train_both(TextClassifier(), lambda m, x, y: F.cross_entropy(m(*x), y), data)


class StyleBlock(nn.Module):
    """conv -> InstanceNorm(affine) -> ReLU -> conv, as in style-transfer and CycleGAN nets."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.InstanceNorm2d(8, affine=True)
        self.out = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.conv(x))))


def test_instance_norm_trains_like_eager_and_under_amp():
    data = [(torch.randn(2, 3, 8, 8), None) for _ in range(3)]
    _train_both(StyleBlock(), lambda m, x, y: m(x).pow(2).mean(), data)
    model = StyleBlock()
    g = make_graph(
        model,
        None,
        torch.optim.SGD(model.parameters(), lr=0.1),
        build=lambda self, x, y: _backward(self.model(x).pow(2).mean()),
        amp=torch.float16,
        scaler=graphamp.GradScaler(),
    )
    g(*data[0])
    rows = [r for r in g.precision_report(with_autocast=False).rows if "batch_norm" in r["op"]]
    assert rows and all(r["colour"] == "allow" for r in rows)  # between the two convolutions
    assert model.norm.weight.dtype == torch.float32 and torch.isfinite(model.norm.weight).all()


@pytest.mark.parametrize("causal_flag", [None, True])
def test_transformer_encoder_with_a_mask_trains_like_eager(causal_flag):
    """PyTorch's tutorial passes a causal mask; torch checks its values to set is_causal."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    data = [(torch.randn(3, 6, 16), None) for _ in range(3)]
    _train_both(encoder, lambda m, x, y: m(x, mask=mask, is_causal=causal_flag).pow(2).mean(), data)


class SparseBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(30, 8, sparse=True)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(self.embedding(x).mean(1))


def _sparse_data():
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 30, (4, 5), generator=gen), torch.tensor([0, 1, 0, 1])) for _ in range(3)
    ]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sparse_gradients_with_sgd_and_a_scaler_train_like_eager(momentum):
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum)  # noqa: E731
    _train_both(
        SparseBag(), lambda m, x, y: F.cross_entropy(m(x), y), _sparse_data(), make_opt=make_opt
    )
    with pytest.warns(UserWarning, match="loss scaling is unnecessary"):
        _train_both(
            SparseBag(),
            lambda m, x, y: F.cross_entropy(m(x), y),
            _sparse_data(),
            make_opt=make_opt,
            scaler=graphamp.GradScaler(init_scale=256.0),
        )


def test_sparse_gradients_with_adam_are_refused_as_in_eager():
    model = SparseBag()
    before = [p.detach().clone() for p in model.parameters()]
    g = make_graph(
        model,
        None,
        torch.optim.Adam(model.parameters(), lr=0.1),
        build=lambda self, x, y: _backward(F.cross_entropy(self.model(x), y)),
    )
    with pytest.raises(graphamp.CaptureError, match=r"sparse gradients.*Adam.*sparse=False"):
        g(*_sparse_data()[0])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
