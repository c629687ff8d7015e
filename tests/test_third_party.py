"""Real library model code (transformers, torchvision, timm) trained through
graphamp, against eager PyTorch.

fp32 (AMP off): the same steps as an eager copy, to rounding noise. Low precision: one step's
loss and gradients close to eager torch.autocast's (fp16 with a scaler, bf16 without). Models
are built from tiny configs; nothing is downloaded.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_state_close, autocast_loss, make_graph

import graphamp

transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")


def _train_like_eager(model, loss_of, batches, make_opt, rtol=1e-5, atol=1e-6, before_step=None):
    """Train ``model`` through a Graph (AMP off) and an eager deepcopy on the same batches."""
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model), make_opt(ref)

    def build(self, x, y):
        loss = loss_of(self.model, x, y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    for step, (x, y) in enumerate(batches):
        if before_step is not None:
            before_step(opt, step)
            before_step(ref_opt, step)
        loss = g(x, y)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = loss_of(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=rtol, atol=atol)
    assert_state_close(model, ref, rtol=rtol, atol=atol)
    return g


def _step_close_to_autocast(model, loss_of, x, y, dtype, tol=None):
    """One graphamp step (SGD lr 1: the update is the gradient) against eager autocast."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = graphamp.GradScaler(init_scale=256.0) if dtype == torch.float16 else None

    def build(self, x, y):
        loss = loss_of(self.model, x, y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build, amp=dtype, scaler=scaler)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = g(x, y)
    assert sum(g.history.fetch()["skipped"]) == 0
    ref_loss = autocast_loss(lambda: loss_of(ref, x, y), dtype)
    tol = tol or (3e-2 if dtype == torch.float16 else 8e-2)
    assert math.isfinite(loss.item())
    assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item())
    num = den = 0.0
    for n, p in ref.named_parameters():
        if p.grad is not None:
            num += float(
                (before[n] - dict(model.named_parameters())[n].detach() - p.grad).pow(2).sum()
            )
            den += float(p.grad.pow(2).sum())
    assert math.sqrt(num / den) < 2 * tol, math.sqrt(num / den)
    return g


def _tokens(n=3, batch=2, seq=12, vocab=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (t, t) for t in (torch.randint(1, vocab, (batch, seq), generator=gen) for _ in range(n))
    ]


def _images(n=3, batch=4, size=32, classes=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, 3, size, size, generator=gen),
            torch.randint(0, classes, (batch,), generator=gen),
        )
        for _ in range(n)
    ]


def _causal_lm_loss(model, x, y):
    return model(input_ids=x, labels=y).loss


def _ce(model, x, y):
    return F.cross_entropy(model(x), y)


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


# -- transformers ---------------------------------------------------------------------------------


def _llama(checkpointing=True):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config)
    if checkpointing:
        _quiet(model.gradient_checkpointing_enable)
    return model.train()


def test_hf_llama_with_gradient_checkpointing_trains_like_eager():
    _quiet(
        lambda: _train_like_eager(
            _llama(),
            _causal_lm_loss,
            _tokens(seq=8),
            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        )
    )


def test_hf_llama_checkpointed_by_graphamp_with_gradient_accumulation_trains_like_eager():
    """graphamp's own checkpointing of every decoder layer, two micro-batches per step: eager
    accumulation (the mean of the micro-batches' losses) step for step."""
    torch.manual_seed(0)
    model = _llama(checkpointing=False)
    layer = type(model.model.layers[0])
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    def configure(g):
        g.config.enable_activation_checkpointing(layer)
        g.config.set_gradient_accumulation_steps(2)

    g = make_graph(model, None, opt, build=_llama_build, configure=configure)
    for x, y in _tokens(n=2, batch=4, seq=8):
        loss = _quiet(lambda: g(x, y))
        ref_opt.zero_grad(set_to_none=True)
        ref_losses = []
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            micro = _causal_lm_loss(ref, xs, ys)
            (micro / 2).backward()
            ref_losses.append(micro.detach())
        ref_opt.step()
        torch.testing.assert_close(loss, torch.stack(ref_losses).mean(), rtol=1e-5, atol=1e-6)
    assert_state_close(model, ref)
    report = g.precision_report(with_autocast=False)
    assert report.recomputed_regions == ("model.model.layers.0",)  # its one decoder layer


def _llama_build(self, x, y):
    loss = _causal_lm_loss(self.model, x, y)
    loss.backward()
    return loss


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_hf_llama_checkpointed_in_low_precision_is_close_to_autocast(dtype):
    ((x, y),) = _tokens(1)
    _quiet(lambda: _step_close_to_autocast(_llama(), _causal_lm_loss, x, y, dtype))


def _t5():
    config = transformers.T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config).train()


def _seq2seq_loss(model, x, y):
    return model(input_ids=x, labels=y[:, :6].contiguous()).loss


def _wo_rows(g):
    rows = g.precision_report(with_autocast=False).rows
    return [r for r in rows if r["module"].endswith(".wo") and r["op"] == "aten.mm"]


def test_hf_t5_keeps_its_declared_fp32_modules_in_fp32_under_fp16():
    """T5 declares _keep_in_fp32_modules = ["wo"]: those Linear layers stay fp32 under fp16,
    the report says why, and setting the attribute to None (transformers' own way) unpins."""
    torch.manual_seed(0)
    model = _t5()
    assert "wo" in model._keep_in_fp32_modules
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def build(self, x, y):
        loss = _seq2seq_loss(self.model, x, y)
        loss.backward()
        return loss

    # backend "eager": this test is about precision decisions, not the compiler
    g = make_graph(
        model,
        None,
        opt,
        build=build,
        amp=torch.float16,
        backend="eager",
        scaler=graphamp.GradScaler(init_scale=256.0),
    )
    ref = copy.deepcopy(model)
    losses = [g(x, y) for x, y in _tokens()]
    assert all(math.isfinite(v.item()) for v in losses)
    rows = _wo_rows(g)
    assert len(rows) == 2  # the encoder's and the decoder's feed-forward output
    for r in rows:
        assert r["dtype"] == "float32", r
        assert "pinned fp32 by the model's _keep_in_fp32_modules ('wo')" in r["why"]
    report = g.precision_report(with_autocast=False)
    assert report.ops_low > report.ops_total // 2  # the rest runs in fp16
    x, y = _tokens()[0]
    ref_loss = autocast_loss(lambda: _seq2seq_loss(ref, x, y), torch.float16, backward=False)
    assert abs(losses[0].item() - ref_loss.item()) < 3e-2 * ref_loss.item()

    model._keep_in_fp32_modules = None  # transformers' opt-out; seen at the next call
    g(x, y)
    assert [r["dtype"] for r in _wo_rows(g)] == ["float16", "float16"]


@pytest.mark.slow
def test_hf_t5_non_strict_fp32_modules_do_not_apply_under_bf16():
    """As in transformers, _keep_in_fp32_modules is about fp16's range; bf16 leaves it alone."""
    model = _t5()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, y):
        loss = _seq2seq_loss(self.model, x, y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build, amp=torch.bfloat16, backend="eager")
    g(*_tokens(1)[0])
    assert [r["dtype"] for r in _wo_rows(g)] == ["bfloat16", "bfloat16"]


def _bloom():
    config = transformers.BloomConfig(
        vocab_size=64,
        hidden_size=32,
        n_layer=1,
        n_head=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.BloomForCausalLM(config).train()


@pytest.mark.slow
def test_hf_bloom_custom_autograd_gelu_trains_like_eager():
    """BLOOM's MLP runs its GeLU through its own torch.autograd.Function (GeLUFunction)."""
    g = _quiet(
        lambda: _train_like_eager(
            _bloom(),
            _causal_lm_loss,
            _tokens(),
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        )
    )
    functions = [
        n.meta["autograd_function"]
        for n in g.compiled_steps[0].forward_graph.graph.nodes
        if "autograd_function" in n.meta
    ]
    assert any("GeLUFunction" in str(f) for f in functions), functions


def _mixtral(experts="grouped_mm"):
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        pad_token_id=0,
    )
    config._experts_implementation = experts
    return transformers.MixtralForCausalLM(config).train()


@pytest.mark.slow
def test_hf_mixtral_experts_custom_op_trains_like_eager():
    """Mixtral's default experts run transformers' own registered operator
    (transformers::grouped_mm_fallback, with its autograd formula) on token groups sorted by
    expert (sort, histc, cumsum offsets)."""
    g = _quiet(
        lambda: _train_like_eager(
            _mixtral(),
            _causal_lm_loss,
            _tokens(),
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        )
    )
    targets = {str(n.target) for n in g.compiled_steps[0].forward_graph.graph.nodes}
    assert "transformers.grouped_mm_fallback.default" in targets


def test_hf_mixtral_eager_expert_loop_is_refused_naming_transformers_line():
    """Mixtral's "eager" experts loop over the experts that received tokens: a Python loop whose
    length is data. graphamp refuses it as its own error, naming the loop's line."""
    model = _mixtral("eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, y):
        loss = _causal_lm_loss(self.model, x, y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(graphamp.CaptureError, match=r"modeling_mixtral\.py:\d+") as info:
        _quiet(lambda: g(*_tokens(1)[0]))
    assert "torch.where" in str(info.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# -- a GPT written here: tied weights, decay groups, SDPA, lr written each step ------------------


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no qkv bias: the key bias's true gradient is zero (softmax ignores a shift shared by
        # all keys), so its computed gradient is rounding noise, which Adam scales up to +-lr
        # in either direction; that compares noise, not graphamp
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4, layers=2, seq=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _gpt_loss(model, x, y):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1))


def _decay_groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3
    )


def _cosine_lr(opt, step, total=5, peak=1e-3):
    for group in opt.param_groups:
        group["lr"] = 0.5 * peak * (1 + math.cos(math.pi * step / total))


def test_gpt_with_tied_weights_decay_groups_and_a_cosine_lr_trains_like_eager():
    model = TinyGPT(layers=1)
    assert model.head.weight is model.tok.weight
    g = _train_like_eager(
        model, _gpt_loss, _tokens(4, seq=16), _decay_groups, before_step=_cosine_lr
    )
    assert model.head.weight is model.tok.weight
    assert len(g.compiled_steps) == 1  # a new lr each step is an input, never a recompile


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpt_in_low_precision_is_close_to_autocast(dtype):
    ((x, y),) = _tokens(1, seq=16)
    _step_close_to_autocast(TinyGPT(), _gpt_loss, x, y, dtype)


# -- torchvision: patterns test_real_models.py does not have --------------------------------------


def _convnext(drop=0.0):
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt(
        [CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)],
        stochastic_depth_prob=drop,
        num_classes=10,
    )


def _swin():
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        patch_size=[2, 2],
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=[4, 4],
        stochastic_depth_prob=0.0,
        num_classes=10,
    )


VISION = {
    # LayerNorm over permuted channels, layer scale, StochasticDepth, patchify stem
    "tv_convnext": (_convnext, 32),
    # shifted windows (torch.roll), attention masks built in forward, relative-position index
    "tv_swin": (_swin, 16),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VISION))
def test_torchvision_model_trains_like_eager(name):
    make, size = VISION[name]
    _train_like_eager(
        make(),
        _ce,
        _images(2, size=size),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VISION))
def test_torchvision_model_in_fp16_is_close_to_autocast(name):
    make, size = VISION[name]
    ((x, y),) = _images(1, size=size)
    _step_close_to_autocast(make(), _ce, x, y, torch.float16)


@pytest.mark.slow
def test_torchvision_stochastic_depth_trains_in_fp16_with_new_masks():
    """Drop-path draws its own masks inside the step: finite, and different every step."""
    torch.manual_seed(0)
    model = _convnext(drop=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = make_graph(
        model, F.cross_entropy, opt, amp=torch.float16, scaler=graphamp.GradScaler(256.0)
    )
    x, y = _images(1)[0]
    losses = [g(x, y).item() for _ in range(3)]
    assert all(math.isfinite(v) for v in losses) and len(set(losses)) == 3


def test_torchvision_deformable_convolution_custom_op_trains_like_eager():
    """torchvision.ops.DeformConv2d calls torchvision's own registered operator
    (torchvision::deform_conv2d) with its C++ backward."""
    from torchvision.ops import DeformConv2d

    class Deformable(nn.Module):
        def __init__(self):
            super().__init__()
            self.offset = nn.Conv2d(3, 2 * 3 * 3, 3, padding=1)
            self.conv = DeformConv2d(3, 8, 3, padding=1)
            self.head = nn.Linear(8, 10)

        def forward(self, x):
            h = self.conv(x, self.offset(x)).relu()
            return self.head(h.mean(dim=(2, 3)))

    g = _train_like_eager(
        Deformable(),
        _ce,
        _images(2, size=8),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
        rtol=1e-4,
        atol=1e-5,
    )
    targets = {str(n.target) for n in g.compiled_steps[0].forward_graph.graph.nodes}
    assert any("deform_conv2d" in t for t in targets), targets


# -- timm (optional) ----------------------------------------------------------------------------


def _timm_models():
    timm = pytest.importorskip("timm")
    from timm.models.convnext import ConvNeXt
    from timm.models.vision_transformer import VisionTransformer

    return {
        "timm_convnext": lambda drop: ConvNeXt(
            depths=(1, 1, 1, 1), dims=(8, 16, 16, 32), num_classes=10, drop_path_rate=drop
        ),
        "timm_vit": lambda drop: VisionTransformer(
            img_size=16,
            patch_size=4,
            embed_dim=32,
            depth=2,
            num_heads=2,
            num_classes=10,
            drop_path_rate=drop,
        ),
    }, timm


@pytest.mark.slow
@pytest.mark.parametrize("name", ["timm_convnext", "timm_vit"])
def test_timm_model_trains_like_eager_and_with_drop_path_in_bf16(name):
    models, _ = _timm_models()
    size = 32 if name == "timm_convnext" else 16
    _train_like_eager(
        models[name](0.0),
        _ce,
        _images(2, size=size),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        rtol=1e-4,
        atol=1e-5,
    )
    model = models[name](0.3)
    g = make_graph(
        model, F.cross_entropy, torch.optim.AdamW(model.parameters(), lr=1e-3), amp=torch.bfloat16
    )
    losses = [g(x, y).item() for x, y in _images(3, size=size)]
    assert all(math.isfinite(v) for v in losses)
