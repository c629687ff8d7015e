"""More training shapes: two optimizers (a GAN), gradient accumulation, structured
inputs. (Several losses, train/eval switching, frozen and tied parameters, recapture and its
cache bound are tested in test_foundation.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_optimizer_close, assert_state_close, make_graph
from models import SmallCNN, seed_mlp

import graphamp
from graphamp import CaptureError, ConfigError, InputError

# -- a GAN in one graph ---------------------------------------------------------------------------


def _gan():
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    disc = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    return gen, disc


def _gan_losses(gen, disc, z, real):
    fake = gen(z)
    ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
    loss_d = F.binary_cross_entropy_with_logits(
        disc(real), ones
    ) + F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros)
    loss_g = F.binary_cross_entropy_with_logits(disc(fake), ones)
    return loss_d, loss_g


def test_gan_generator_and_discriminator_in_one_graph():
    gen, disc = _gan()
    ref_gen, ref_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-3, betas=(0.5, 0.999))
    ref_opt_g = torch.optim.Adam(ref_gen.parameters(), lr=2e-3, betas=(0.5, 0.999))
    ref_opt_d = torch.optim.Adam(ref_disc.parameters(), lr=2e-3, betas=(0.5, 0.999))

    class GAN(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.gen, self.disc = gen, disc
            self.add_optimizer(opt_g)
            self.add_optimizer(opt_d)
            self.config.set_backend("aot_eager")

        def build(self, z, real):
            loss_d, loss_g = _gan_losses(self.gen, self.disc, z, real)
            # each loss trains its own network, as with two eager backward(inputs=...) calls
            loss_d.backward(inputs=list(self.disc.parameters()))
            loss_g.backward(inputs=list(self.gen.parameters()))
            return loss_d, loss_g

    g = GAN()
    for _step in range(5):
        z, real = torch.randn(16, 8), torch.randn(16, 16) + 2.0
        loss_d, loss_g = g(z, real)
        ref_opt_g.zero_grad()
        ref_opt_d.zero_grad()
        ref_d, ref_g = _gan_losses(ref_gen, ref_disc, z, real)
        ref_d.backward(inputs=list(ref_disc.parameters()))
        ref_g.backward(inputs=list(ref_gen.parameters()))
        ref_opt_d.step()
        ref_opt_g.step()
        torch.testing.assert_close(loss_d, ref_d.detach())
        torch.testing.assert_close(loss_g, ref_g.detach())
    assert_state_close(gen, ref_gen)
    assert_state_close(disc, ref_disc)
    assert_optimizer_close(opt_d, ref_opt_d)


def test_backward_inputs_must_be_parameters():
    model = seed_mlp()

    def build(self, x, y):
        h = self.model[0](x)
        loss = F.cross_entropy(self.model[2](torch.relu(h)), y)
        loss.backward(inputs=[h])
        return loss

    g = make_graph(model, None, torch.optim.SGD(model.parameters(), lr=0.1), build=build)
    with pytest.raises(CaptureError, match="not a parameter of a registered module"):
        g(torch.randn(4, 256), torch.randint(0, 10, (4,)))


# -- gradient accumulation ------------------------------------------------------------------------


def _eager_accumulation(model, opt, x, y, n):
    opt.zero_grad()
    losses = []
    for xs, ys in zip(x.chunk(n), y.chunk(n)):
        loss = F.cross_entropy(model(xs), ys) / n
        loss.backward()
        losses.append(loss.detach() * n)
    opt.step()
    return torch.stack(losses).mean()


@pytest.mark.parametrize(
    "factory, shape",
    [(seed_mlp, (32, 256)), (SmallCNN, (32, 3, 16, 16))],
    ids=["mlp", "cnn_batchnorm"],
)
def test_gradient_accumulation_equals_eager_accumulation(factory, shape):
    model = factory()
    ref = copy.deepcopy(model)
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    opt, ref_opt = make_opt(model), make_opt(ref)
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        opt,
        configure=lambda self: self.config.set_gradient_accumulation_steps(4),
    )
    for _ in range(3):
        x, y = torch.randn(*shape), torch.randint(0, 10, (shape[0],))
        loss = g(x, y)
        ref_loss = _eager_accumulation(ref, ref_opt, x, y, 4)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_state_close(model, ref)  # BatchNorm statistics updated once per micro-batch, too
    assert_optimizer_close(opt, ref_opt)


def test_gradient_accumulation_makes_one_scaler_decision_per_step():
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=256.0),
        configure=lambda self: self.config.set_gradient_accumulation_steps(4),
    )
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
    x[20, 0] = float("inf")  # in the third micro-batch only
    g(x, y)
    history = g.history.fetch()
    assert history["skipped"] == [1.0] and g.grad_scaler.get_scale() == 128.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    out = g(torch.randn(32, 256), torch.randint(0, 10, (32,)))
    assert out.dim() == 0 and g.history.fetch()["skipped"] == [1.0, 0.0]


def test_gradient_accumulation_returns_batched_outputs_whole():
    model = seed_mlp()

    def build(self, x, y):
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        return loss, logits

    g = make_graph(
        model,
        None,
        torch.optim.SGD(model.parameters(), lr=0.0),
        build=build,
        configure=lambda self: self.config.set_gradient_accumulation_steps(2),
    )
    x, y = torch.randn(8, 256), torch.randint(0, 10, (8,))
    expected = model(x).detach()
    loss, logits = g(x, y)
    torch.testing.assert_close(logits, expected)  # micro-batches concatenated back
    torch.testing.assert_close(loss, F.cross_entropy(expected, y))


def test_gradient_accumulation_rejects_batches_it_cannot_split():
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        configure=lambda self: self.config.set_gradient_accumulation_steps(3),
    )
    with pytest.raises(InputError, match="multiple of 3"):
        g(torch.randn(8, 256), torch.randint(0, 10, (8,)))


def test_gradient_accumulation_needs_an_optimizer():
    model = seed_mlp()

    class Eval(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.config.set_gradient_accumulation_steps(2)

        def build(self, x):
            return self.model(x)

    with pytest.raises(ConfigError, match="no optimizer"):
        Eval()(torch.randn(4, 256))


# -- structured inputs ----------------------------------------------------------------------------


def test_inputs_as_dicts_and_tuples():
    model = seed_mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    class G(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_backend("aot_eager")

        def build(self, batch, extra=(None, 1.0)):
            logits = self.model(batch["x"])
            loss = F.cross_entropy(logits, batch["y"]) * extra[1]
            loss.backward()
            return {"loss": loss, "logits": logits}

    g = G()
    for _ in range(2):
        batch = {"x": torch.randn(8, 256), "y": torch.randint(0, 10, (8,))}
        out = g(batch, extra=("note", 0.5))
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(ref(batch["x"]), batch["y"]) * 0.5
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(out["loss"], ref_loss.detach())
    assert_state_close(model, ref)
    assert len(g.compiled_steps) == 1
    g({"x": torch.randn(8, 256), "y": torch.randint(0, 10, (8,))}, extra=("note", 0.25))
    assert len(g.compiled_steps) == 2  # a new constant is a new signature (it is baked in)


# -- accuracy on real data ------------------------------------------------------------------------


@pytest.mark.slow
def test_every_precision_reaches_its_baseline_accuracy_on_real_data():
    """examples/accuracy.py in its tiny mode: pydoc's text and scikit-learn's digits; fp16 and
    bf16 within 1% of fp32, fp8 (each recipe) within 1% of bf16."""
    pytest.importorskip("sklearn")
    import importlib.util
    import os

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "accuracy.py"
    )
    spec = importlib.util.spec_from_file_location("graphamp_accuracy_example", path)
    accuracy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(accuracy)
    results = accuracy.run(tiny=True)
    for name in ("fp16", "bf16", "fp8", "fp8_rowwise", "fp8_delayed"):  # fp8 against bf16
        assert abs(results["char_lm"][name]["val_loss_rel_diff"]) < 0.01
        assert abs(results["digits"][name]["test_accuracy_rel_diff"]) < 0.01
