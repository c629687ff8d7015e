"""A Graph trains like eager PyTorch (fp32), for real models and optimizers."""

from __future__ import annotations

import copy
import logging

import models
import pytest
import torch
import torch.nn as nn
from helpers import (
    assert_optimizer_close,
    assert_state_close,
    clone_training,
    eager_step,
    make_graph,
)
from models import SmallCNN, TinyGPT, lm_loss, seed_mlp

import graphamp


def _data(kind: str, steps: int):
    if kind == "mlp":
        return models.batches(steps, 128, 256, 10, seed=1)
    if kind == "cnn":
        return models.batches(steps, 8, (3, 16, 16), 10, seed=1)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, 64, (4, 17), generator=g)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


MODELS = {
    "mlp": (seed_mlp, nn.CrossEntropyLoss()),
    "cnn": (SmallCNN, nn.CrossEntropyLoss()),
    "gpt": (TinyGPT, lm_loss),
}
OPTIMIZERS = {
    "sgd_momentum": (
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4),
        None,
    ),
    "adamw_scheduler": (
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1),
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    ),
}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_five_steps_match_eager_fp32(model_name, opt_name):
    factory, loss_fn = MODELS[model_name]
    make_opt, make_sch = OPTIMIZERS[opt_name]
    model = factory()
    ref, ref_opt, ref_sch = clone_training(model, make_opt, make_sch)
    opt = make_opt(model)
    sch = make_sch(opt) if make_sch else None
    g = make_graph(model, loss_fn, opt, lr_sch=sch)
    for x, y in _data(model_name, 5):
        loss = g(x, y)
        ref_loss = eager_step(ref, loss_fn, ref_opt, x, y, ref_sch)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_state_close(model, ref)  # parameters and BatchNorm running statistics
    assert_optimizer_close(opt, ref_opt)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert len(g.compiled_steps) == 1, "a changing learning rate must not recompile"


@pytest.mark.inductor
def test_inductor_end_to_end_matches_eager():
    model = SmallCNN()
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    ref, ref_opt, _ = clone_training(model, make_opt)
    opt = make_opt(model)
    g = make_graph(model, nn.CrossEntropyLoss(), opt, backend="inductor")
    for x, y in _data("cnn", 3):
        loss = g(x, y)
        ref_loss = eager_step(ref, nn.CrossEntropyLoss(), ref_opt, x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    assert_state_close(model, ref, rtol=1e-4, atol=1e-5)
    assert_optimizer_close(opt, ref_opt, rtol=1e-4, atol=1e-5)


def test_state_is_written_back_in_place_and_checkpoints_are_plain_torch():
    model = seed_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    weight = model[0].weight
    data = _data("mlp", 4)
    for x, y in data[:2]:
        g(x, y)
    assert model[0].weight is weight  # the user's Parameter objects stay the truth
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # as torch.save would: not live references
    assert saved_opt["state"][0]["step"].item() == 2.0
    # an ordinary torch checkpoint continues eagerly exactly like the graph would
    eager_model = seed_mlp()
    eager_model.load_state_dict(saved_model)
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=1e-3)
    eager_opt.load_state_dict(saved_opt)
    for x, y in data[2:]:
        g(x, y)
        eager_step(eager_model, nn.CrossEntropyLoss(), eager_opt, x, y)
    assert_state_close(model, eager_model)


def test_sgd_variants_and_param_groups_match_eager():
    def make_opt(m):
        return torch.optim.SGD(
            [
                {"params": m[0].parameters(), "lr": 0.1, "momentum": 0.9, "dampening": 0.3},
                {
                    "params": m[2].weight,
                    "lr": 0.05,
                    "momentum": 0.8,
                    "nesterov": True,
                    "weight_decay": 1e-2,
                },
                {"params": m[2].bias, "lr": 0.02, "maximize": True},
            ],
            lr=0.01,
        )

    model = seed_mlp()
    ref, ref_opt, _ = clone_training(model, make_opt)
    opt = make_opt(model)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    for x, y in _data("mlp", 4):
        torch.testing.assert_close(g(x, y), eager_step(ref, nn.CrossEntropyLoss(), ref_opt, x, y))
    assert_state_close(model, ref)
    assert_optimizer_close(opt, ref_opt)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"amsgrad": True},
        {"weight_decay": 0.05},
        {"betas": (0.8, 0.95), "eps": 1e-6, "maximize": True},
    ],
)
def test_adam_options_match_eager(kwargs):
    make_opt = lambda m: torch.optim.Adam(m.parameters(), lr=3e-3, **kwargs)  # noqa: E731
    model = seed_mlp()
    ref, ref_opt, _ = clone_training(model, make_opt)
    opt = make_opt(model)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    for x, y in _data("mlp", 4):
        torch.testing.assert_close(g(x, y), eager_step(ref, nn.CrossEntropyLoss(), ref_opt, x, y))
    assert_state_close(model, ref)
    assert_optimizer_close(opt, ref_opt)


def test_learning_rate_schedule_is_a_graph_input():
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    make_sch = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))  # noqa: E731
    model = seed_mlp()
    ref, ref_opt, ref_sch = clone_training(model, make_opt, make_sch)
    opt = make_opt(model)
    sch = make_sch(opt)
    g = make_graph(model, nn.CrossEntropyLoss(), opt, lr_sch=sch)
    for x, y in _data("mlp", 5):
        g(x, y)
        eager_step(ref, nn.CrossEntropyLoss(), ref_opt, x, y, ref_sch)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / 6)
    assert_state_close(model, ref)
    assert len(g.compiled_steps) == 1


def test_frozen_and_unused_parameters_are_left_alone_like_eager():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.used = nn.Linear(8, 2)
            self.unused = nn.Linear(8, 2)

        def forward(self, x):
            return self.used(torch.relu(self.body(x)))

    make_opt = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.5)  # noqa: E731
    model = TwoHeads()
    model.body.bias.requires_grad_(False)
    ref, ref_opt, _ = clone_training(model, make_opt)
    opt = make_opt(model)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    for _ in range(3):
        g(x, y)
        eager_step(ref, nn.CrossEntropyLoss(), ref_opt, x, y)
    assert_state_close(model, ref)
    assert_optimizer_close(opt, ref_opt)  # no state for the frozen and the unused parameters


def test_build_may_return_any_structure():
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, y):
        logits = self.model(x)
        loss = nn.functional.cross_entropy(logits, y)
        loss.backward()
        return {"loss": loss, "pred": (logits.argmax(1), logits), "note": "ok", "n": 3}

    g = make_graph(model, None, opt, build=build)
    x, y = torch.randn(16, 256), torch.randint(0, 10, (16,))
    expected_logits = model(x).detach()
    out = g(x, y)
    assert set(out) == {"loss", "pred", "note", "n"}
    assert out["note"] == "ok" and out["n"] == 3
    pred, logits = out["pred"]
    torch.testing.assert_close(logits, expected_logits)  # the forward before the update
    assert torch.equal(pred, expected_logits.argmax(1))
    assert not out["loss"].requires_grad


def _eval_graph(model):
    class Eval(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.config.set_backend("aot_eager")

        def build(self, x):
            return self.model(x)

    return Eval()


def test_eval_graph_compiles_forward_only():
    model = SmallCNN()
    model.eval()
    g = _eval_graph(model)
    x = torch.randn(4, 3, 16, 16)
    torch.testing.assert_close(g(x), model(x), rtol=1e-5, atol=1e-6)
    (step,) = g.compiled_steps
    assert not step.training and step.calls == 1 and step.step_nodes > 0
    assert "optimizer" not in {n.meta.get("graphamp_subgraph") for n in step.step_graph.graph.nodes}


def test_eval_graph_in_train_mode_updates_batchnorm_statistics():
    model = SmallCNN()
    ref = copy.deepcopy(model)
    g = _eval_graph(model)
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        expected = ref(x)
    torch.testing.assert_close(g(x), expected, rtol=1e-5, atol=1e-6)
    assert_state_close(model, ref)
    assert model.features[1].num_batches_tracked.item() == 1


@pytest.mark.parametrize("dynamic", [None, False])
def test_new_input_shape_recaptures_and_says_so(caplog, dynamic):
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        configure=lambda self: self.config.set_dynamic_shapes(dynamic),
    )
    g(torch.randn(8, 256), torch.randint(0, 10, (8,)))
    with caplog.at_level(logging.INFO, logger="graphamp"):
        g(torch.randn(4, 256), torch.randint(0, 10, (4,)))
        g(torch.randn(8, 256), torch.randint(0, 10, (8,)))
    assert len(g.compiled_steps) == 2
    messages = [
        r.getMessage() for r in caplog.records if "capturing and compiling" in r.getMessage()
    ]
    assert len(messages) == 1 and "input 'x' dimension 0 changed size (8 to 4)" in messages[0]
    assert ("dynamic" in messages[0]) == (dynamic is None)


def test_cache_is_bounded():
    model = seed_mlp()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        configure=lambda self: (
            self.config.set_max_cached_graphs(2),
            self.config.set_dynamic_shapes(False),
        ),
    )
    for batch in (2, 3, 4):
        g(torch.randn(batch, 256), torch.randint(0, 10, (batch,)))
    assert len(g.compiled_steps) == 2


def test_train_eval_switch_recaptures():
    model = SmallCNN(dropout=0.5)
    g = make_graph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    g(x, y)
    model.eval()
    g(x, y)
    model.train()
    g(x, y)
    assert len(g.compiled_steps) == 2


def test_dropout_draws_a_new_mask_each_step_reproducibly():
    def run(seed):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.5), nn.Linear(64, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: only the masks change

        def build(self, x, y):
            out = self.model(x)
            loss = nn.functional.mse_loss(out, y)
            loss.backward()
            return out

        g = make_graph(model, None, opt, build=build)
        x, y = torch.randn(16, 32), torch.randn(16, 4)
        torch.manual_seed(seed)
        return [g(x, y) for _ in range(3)]

    a, b, c = run(1), run(1), run(2)
    for u, v in zip(a, b):
        assert torch.equal(u, v)  # same seed, same masks
    assert not torch.equal(a[0], a[1])  # a new mask every step
    assert not torch.equal(a[0], c[0])  # a different seed, different masks


def test_no_grad_region_in_build_blocks_gradients_like_eager():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    ref, ref_opt, _ = clone_training(model, make_opt)
    opt = make_opt(model)

    def loss_of(m, x):
        with torch.no_grad():
            target = m[0](x).sum(dim=1, keepdim=True)
        return ((m(x) - target) ** 2).mean()

    def build(self, x, y):
        loss = loss_of(self.model, x)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    x = torch.randn(4, 8)
    for _ in range(3):
        g(x, None)
        ref_opt.zero_grad()
        loss_of(ref, x).backward()
        ref_opt.step()
    assert_state_close(model, ref)


def test_several_backward_calls_add_gradients():
    model = seed_mlp()
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    ref, ref_opt, _ = clone_training(model, make_opt)
    opt = make_opt(model)

    def build(self, x, y):
        out = self.model(x)
        a = nn.functional.cross_entropy(out, y)
        b = out.pow(2).mean() * 0.1
        a.backward(retain_graph=True)
        b.backward()
        return a, b

    g = make_graph(model, None, opt, build=build)
    x, y = torch.randn(8, 256), torch.randint(0, 10, (8,))
    g(x, y)
    ref_opt.zero_grad()
    out = ref(x)
    (nn.functional.cross_entropy(out, y) + out.pow(2).mean() * 0.1).backward()
    ref_opt.step()
    assert_state_close(model, ref)


def test_backward_with_explicit_gradient_like_insightface():
    model = nn.Linear(16, 8)
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    ref, ref_opt, _ = clone_training(model, make_opt)
    opt = make_opt(model)

    def build(self, x, grad):
        features = nn.functional.normalize(self.model(x))
        features.backward(grad)
        return features

    g = make_graph(model, None, opt, build=build)
    x, grad = torch.randn(4, 16), torch.randn(4, 8)
    g(x, grad)
    ref_opt.zero_grad()
    nn.functional.normalize(ref(x)).backward(grad)
    ref_opt.step()
    assert_state_close(model, ref)


def test_tied_weights_train_like_eager():
    model = TinyGPT()
    model.head.weight = model.wte.weight
    make_opt = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)  # noqa: E731
    ref, ref_opt, _ = clone_training(model, make_opt)
    opt = make_opt(model)
    g = make_graph(model, lm_loss, opt)
    for x, y in _data("gpt", 3):
        torch.testing.assert_close(g(x, y), eager_step(ref, lm_loss, ref_opt, x, y))
    assert model.head.weight is model.wte.weight
    assert_state_close(model, ref)


def test_no_host_sync_ops_in_the_captured_step():
    model = SmallCNN()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.float16,
        scaler=graphamp.GradScaler(),
    )
    g(torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    targets = {str(n.target) for n in g.compiled_steps[-1].step_graph.graph.nodes}
    assert "aten._local_scalar_dense.default" not in targets
    assert not any(t.endswith(".item") for t in targets)
