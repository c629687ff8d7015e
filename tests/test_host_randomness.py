"""Random numbers drawn on the host inside build(): refused at capture, never frozen.

build() is captured once; a draw from Python's random or NumPy there would become a constant
of every step. Refused with the library's line, the user's line and the fix, the generators
and the user's objects unchanged. torch's own random ops keep working (new draws each step).
"""

from __future__ import annotations

import copy
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_unchanged, make_graph, snapshot

from graphamp import CaptureError

THIS_FILE = __file__.rsplit("/", 1)[-1]


def _line(case: str) -> str:
    for number, text in enumerate(open(__file__).read().splitlines(), start=1):
        if text.rstrip().endswith(f"# draws: {case}"):
            return f"{THIS_FILE}:{number}"
    raise LookupError(case)


class Jitter(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how
        self.rng = np.random.RandomState(0)

    def forward(self, x):
        if self.how == "python":
            x = x * random.uniform(0.5, 1.5)  # draws: python
        elif self.how == "numpy":
            x = x * float(np.random.beta(0.4, 0.4))  # draws: numpy
        elif self.how == "fresh generator":
            x = x * float(np.random.default_rng().random())  # draws: fresh generator
        elif self.how == "seeded generator":
            x = x * float(np.random.default_rng(seed=3).random())
        elif self.how == "generator on the module":
            x = x * float(self.rng.rand())  # draws: generator on the module
        return self.lin(x)


_EXPECTED = {
    "python": r"random\.uniform\(\) at .*" + _line("python"),
    "numpy": r"numpy\.random\.beta\(\) at .*" + _line("numpy"),
    "generator on the module": r"from self\.model\.rng",
    "fresh generator": r"numpy\.random\.default_rng\(\) without a seed at .*"
    + _line("fresh generator"),
}


def _generator_states(model):
    return (random.getstate(), np.random.get_state()[1].copy(), model.rng.get_state()[1].copy())


@pytest.mark.parametrize("how", sorted(_EXPECTED))
def test_a_host_draw_in_build_is_refused_with_the_line_and_the_fix(how):
    model = Jitter(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    state, generators = snapshot(model, opt), _generator_states(model)
    with pytest.raises(CaptureError, match=_EXPECTED[how]) as info:
        g(torch.randn(2, 4), torch.randn(2, 4))
    assert "outside build()" in str(info.value) and "torch.rand" in str(info.value)
    after = _generator_states(model)
    assert after[0] == generators[0]
    assert (after[1] == generators[1]).all() and (after[2] == generators[2]).all()
    assert_unchanged(state, model, opt)
    assert g.step_count == 0


def test_a_generator_made_from_a_fixed_seed_in_build_trains_like_eager():
    """A seeded generator draws the same value on every eager call: capture keeps it, right."""
    torch.manual_seed(0)
    model = Jitter("seeded generator")
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = make_graph(model, F.mse_loss, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        x, y = torch.randn(2, 4), torch.randn(2, 4)
        loss = g(x, y)
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(model.lin.weight, ref.lin.weight)


def test_torch_random_ops_in_build_are_drawn_anew_every_step():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def build(self, x, y):
        noise = torch.rand(())
        loss = F.mse_loss(self.model(x * noise), y)
        loss.backward()
        return loss, noise

    g = make_graph(model, None, opt, build=build)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    draws = {g(x, y)[1].item() for _ in range(3)}
    assert len(draws) == 3


def test_timm_mixup_in_build_is_refused_naming_timm_and_the_users_line():
    """timm's Mixup draws its lambda and the mixup/cutmix choice with NumPy: every step would
    mix with the first step's lambda. The fix: mix the batch before g(...)."""
    timm_mixup = pytest.importorskip("timm.data.mixup")
    mix = timm_mixup.Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=4)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, y):
        x, y = mix(x, y)  # draws: timm
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    state = snapshot(model, opt)
    with pytest.raises(CaptureError, match=r"timm/data/mixup\.py:\d+") as info:
        g(torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))
    assert _line("timm") in str(info.value)
    assert_unchanged(state, model, opt)


def test_wav2vec2_spec_augment_masks_are_refused_not_frozen():
    """Wav2Vec2 in training draws its SpecAugment time masks with NumPy
    (_compute_mask_indices); refused naming transformers' line. Passing mask_time_indices, drawn
    outside build(), trains."""
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
        mask_time_prob=0.3,
        mask_time_length=2,
        layerdrop=0.0,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
    )
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(config).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, masks):
        out = self.model(input_values=x, mask_time_indices=masks)  # draws: wav2vec2
        loss = out.last_hidden_state.pow(2).mean()
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    x = torch.randn(2, 400)
    state = snapshot(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CaptureError, match=r"modeling_wav2vec2\.py:\d+") as info:
            g(x, None)
        assert_unchanged(state, model, opt)
        frames = model._get_feat_extract_output_lengths(400)
        masks = transformers.models.wav2vec2.modeling_wav2vec2._compute_mask_indices(
            (2, int(frames)), mask_prob=0.3, mask_length=2, min_masks=2
        )
        masks = torch.from_numpy(masks)
        ref = copy.deepcopy(model)
        ref_loss = ref(input_values=x, mask_time_indices=masks).last_hidden_state.pow(2).mean()
        torch.testing.assert_close(g(x, masks), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert "numpy.random" in str(info.value) and "_compute_mask_indices" in str(info.value)
    assert _line("wav2vec2") in str(info.value)
