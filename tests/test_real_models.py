"""Real architectures (torchvision; transformers from a config, no downloads) train
through a Graph in fp16 + GradScaler and in bf16, and agree with eager torch.autocast."""

from __future__ import annotations

import copy
import importlib
import math
import warnings

import pytest
import torch
import torch.nn as nn
from helpers import autocast_loss, make_graph

import graphamp


def _optional(module: str):
    """The library, or None where it is absent or does not import beside this torch (PyPI's
    torchvision is built for one torch release): its models are then skipped, not the file."""
    try:
        return importlib.import_module(module)
    except Exception:  # ImportError, or torchvision's operator registration error
        return None


torchvision = _optional("torchvision")
transformers = _optional("transformers")


def _hf_loss(out, y):
    return nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1))


def _hf_config(cls, **kw):
    # dropout off: graphamp and eager would draw different masks (tested apart, test_foundation)
    return cls(bos_token_id=0, eos_token_id=0, pad_token_id=0, vocab_size=100, **kw)


def _images():
    return torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))


def _tokens():
    return torch.randint(1, 100, (2, 16)), torch.randint(1, 100, (2, 16))


MODELS = {
    "resnet18": (
        lambda: torchvision.models.resnet18(num_classes=10),
        nn.CrossEntropyLoss(),
        _images,
    ),
    "resnet50": (
        lambda: torchvision.models.resnet50(num_classes=10),
        nn.CrossEntropyLoss(),
        _images,
    ),
    "mobilenet_v3": (
        lambda: torchvision.models.mobilenet_v3_small(num_classes=10, dropout=0.0),
        nn.CrossEntropyLoss(),
        _images,
    ),
    "vit": (
        lambda: torchvision.models.VisionTransformer(
            image_size=32,
            patch_size=8,
            num_layers=2,
            num_heads=2,
            hidden_dim=32,
            mlp_dim=64,
            num_classes=10,
        ),
        nn.CrossEntropyLoss(),
        _images,
    ),
    "hf_gpt2": (
        lambda: transformers.GPT2LMHeadModel(
            _hf_config(
                transformers.GPT2Config,
                n_layer=2,
                n_embd=32,
                n_head=2,
                n_positions=32,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        ),
        _hf_loss,
        _tokens,
    ),
    "hf_bert": (
        lambda: transformers.BertForMaskedLM(
            _hf_config(
                transformers.BertConfig,
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=32,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        ),
        _hf_loss,
        _tokens,
    ),
    # its attention masks with torch.finfo(query.dtype).min: fp32's value at capture
    "hf_deberta": (
        lambda: transformers.DebertaV2ForMaskedLM(
            _hf_config(
                transformers.DebertaV2Config,
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=32,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        ),
        _hf_loss,
        _tokens,
    ),
}


_LARGE = {"resnet18", "resnet50", "mobilenet_v3"}  # the slowest: whole-suite runs only


def _train_step_grads(model, loss_fn, x, y, dtype):
    """graphamp's loss and the gradient it applied (SGD lr 1: update = gradient)."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    # ResNet-50 at 32x32 with batch 4 has gradients up to ~1800: scale 8 keeps fp16 finite
    scaler = graphamp.GradScaler(init_scale=8.0) if dtype == torch.float16 else None
    g = make_graph(model, loss_fn, opt, amp=dtype, scaler=scaler)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = g(x, y)
    assert sum(g.history.fetch()["skipped"]) == 0
    return g, loss, {n: before[n] - p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in _LARGE else n for n in sorted(MODELS)],
)
def test_real_model_agrees_with_eager_autocast(name, dtype):
    library = "transformers" if name.startswith("hf_") else "torchvision"
    if {"transformers": transformers, "torchvision": torchvision}[library] is None:
        pytest.skip(f"{library} is not installed beside torch {torch.__version__}")
    make, loss_fn, data = MODELS[name]
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    x, y = data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g, loss, grads = _train_step_grads(model, loss_fn, x, y, dtype)
    ref_loss = autocast_loss(lambda: loss_fn(ref(x), y), dtype)
    tol = 3e-2 if dtype == torch.float16 else 8e-2
    assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item())
    num = den = 0.0
    for n, p in ref.named_parameters():
        if p.grad is not None:
            num += float((grads[n] - p.grad).pow(2).sum())
            den += float(p.grad.pow(2).sum())
    assert math.sqrt(num / den) < tol * 2, (name, math.sqrt(num / den))
    report = g.precision_report(with_autocast=False)
    assert report.ops_low > report.ops_total // 2  # the bulk runs in low precision
    assert isinstance(report.unknown_ops, dict)  # unknown ops are listed, not fatal


def test_an_op_the_lists_have_never_seen_is_reported_not_fatal():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.b(torch.special.i0(self.a(x)))

    model = Odd()
    g = make_graph(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=torch.bfloat16,
    )
    g(torch.randn(4, 8), torch.randint(0, 2, (4,)))
    report = g.precision_report(with_autocast=False)
    assert report.unknown_ops == {"aten.i0": 1}
    assert "1 unknown op kept fp32: aten.i0" in report.summary()
