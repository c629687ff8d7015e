"""graphamp.training_step: a Graph made from a plain step function, checked against the same
step written as a Graph subclass and against eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import autocast_step, eager_step, make_graph
from models import SmallCNN, seed_mlp

import graphamp


def _batch(n=16):
    return torch.randn(n, 256), torch.randint(0, 10, (n,))


def test_a_decorated_function_trains_as_eager_pytorch():
    model = seed_mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sch = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)

    @graphamp.training_step(model, opt, lr_sch=sch)
    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    assert isinstance(train_step, graphamp.Graph) and type(train_step).__name__ == "train_step"
    train_step.config.set_backend("aot_eager")
    for _ in range(4):
        x, y = _batch()
        loss = train_step(x, y)
        ref_loss = eager_step(ref, nn.CrossEntropyLoss(), ref_opt, x, y, ref_sch)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 2.5e-3


def test_the_decorated_step_is_the_subclass_step_with_the_same_inspection(tmp_path):
    """fp16 + scaler + clipping: the function and the subclass give bitwise the same step, and
    print, precision_report, dump, state_dict and compiled_steps work on the function's."""
    torch.manual_seed(0)
    model = SmallCNN()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)

    @graphamp.training_step(
        model, opt, amp=torch.float16, scaler=graphamp.GradScaler(2.0**8), clip_grad_max_norm=1.0
    )
    def cnn_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    cnn_step.config.set_backend("aot_eager")
    subclass = make_graph(
        twin,
        nn.CrossEntropyLoss(),
        twin_opt,
        amp=torch.float16,
        scaler=graphamp.GradScaler(2.0**8),
        clip=1.0,
    )
    for _ in range(3):
        x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
        assert torch.equal(cnn_step(x, y), subclass(x, y))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert "(GRAPH:cnn_step" in repr(cnn_step) and "OPTIMIZER:0:SGD" in repr(cnn_step)
    report = cnn_step.precision_report(with_autocast=False)
    assert report.ops_low > 0
    cnn_step.dump(str(tmp_path / "dump"))
    assert (tmp_path / "dump" / "report.html").is_file()
    assert cnn_step.compiled_steps[-1].calls == 3 and cnn_step.compiled_steps[-1].amp_dtype
    state = cnn_step.state_dict()
    assert state["step"] == 3 and state["grad_scaler"]["scale"] == 2.0**8
    cnn_step.load_state_dict(subclass.state_dict())


def test_several_modules_and_optimizers_by_name():
    """A GAN-style step: two modules registered by name, two optimizers, one call."""
    gen, disc = nn.Linear(4, 8), nn.Linear(8, 1)
    gen_opt = torch.optim.SGD(gen.parameters(), lr=0.1)
    disc_opt = torch.optim.SGD(disc.parameters(), lr=0.1)

    @graphamp.training_step({"generator": gen, "discriminator": disc}, [gen_opt, disc_opt])
    def gan_step(z, real):
        fake = gen(z)
        d_loss = F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
        d_loss.backward(inputs=list(disc.parameters()))
        g_loss = F.softplus(-disc(fake)).mean()
        g_loss.backward(inputs=list(gen.parameters()))
        return d_loss, g_loss

    gan_step.config.set_backend("aot_eager")
    before = gen.weight.detach().clone(), disc.weight.detach().clone()
    d_loss, g_loss = gan_step(torch.randn(8, 4), torch.randn(8, 8))
    assert d_loss.isfinite() and g_loss.isfinite()
    assert not torch.equal(before[0], gen.weight) and not torch.equal(before[1], disc.weight)
    assert set(gan_step._registered_modules) == {"generator", "discriminator"}


def test_an_eval_step_has_no_optimizer():
    model = seed_mlp()

    @graphamp.training_step(model, amp=torch.bfloat16)
    def predict(x):
        return model(x).argmax(1)

    predict.config.set_backend("aot_eager")
    before = copy.deepcopy(model.state_dict())
    x, _ = _batch()
    out = predict(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x).argmax(1)
    assert (out == expected).float().mean() > 0.9
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m, o: graphamp.training_step(m, o, amp=torch.float64), "amp is torch.float16"),
        (lambda m, o: graphamp.training_step({"config": m}, o), "'config' cannot name a module"),
        (lambda m, o: graphamp.training_step("model", o), "takes the model"),
        (lambda m, o: graphamp.training_step(m, "opt"), "torch.optim.Optimizer"),
        (lambda m, o: graphamp.training_step(m, [o], lr_sch=[None, None]), "one scheduler per"),
    ],
)
def test_wrong_arguments_are_refused_by_name(call, match):
    model = seed_mlp()
    with pytest.raises(graphamp.ConfigError, match=match):
        call(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_scaled_fp16_step_follows_eager_autocast():
    """fp16 with a scaler against torch.autocast + torch.amp.GradScaler (the project's
    oracle): the first step's loss within 3% (tests/test_real_models.py's bound)."""
    model = seed_mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    @graphamp.training_step(model, opt, amp=torch.float16, scaler=graphamp.GradScaler())
    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    train_step.config.set_backend("aot_eager")
    x, y = _batch()
    loss = train_step(x, y)
    eager = autocast_step(
        lambda: F.cross_entropy(ref(x), y), ref_opt, torch.float16, torch.amp.GradScaler("cpu")
    )
    assert abs(loss.item() - eager.loss.float().item()) <= 3e-2 * abs(eager.loss.item())
