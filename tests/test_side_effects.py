"""Python side effects that libraries rely on, against eager PyTorch.

transformers installs output-capturing hooks on first use (hidden states, attentions, a
mixture-of-experts' router logits); rotary embeddings build caches on first use; torchvision's
RAFT keeps the correlation pyramid it builds and reads in the same forward. Each trains as in
eager, and what eager leaves on the user's objects after a call is there after graphamp's.
What cannot be replayed (a Python value that changes on every call, a value one call leaves
for the next) is refused by name, the user's objects put back as they were.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_state_close, assert_unchanged, make_graph, snapshot

import graphamp
from graphamp import CaptureError

transformers = pytest.importorskip("transformers")


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def _train_like_eager(model, loss_of, batches, lr=0.1, rtol=1e-5, atol=1e-6, **graph_kwargs):
    """Train ``model`` through a Graph and an eager deepcopy; compare losses and parameters.
    ``loss_of(model, *batch)`` returns (loss, anything else build() returns)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)

    def build(self, x, y):
        loss, extra = loss_of(self.model, x, y)
        loss.backward()
        return loss, extra

    g = make_graph(model, None, opt, build=build, **graph_kwargs)
    for x, y in batches:
        loss, extra = _quiet(lambda: g(x, y))
        ref_opt.zero_grad(set_to_none=True)
        ref_loss, ref_extra = _quiet(lambda: loss_of(ref, x, y))
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=rtol, atol=atol)
        torch.testing.assert_close(extra, _detached(ref_extra), rtol=rtol, atol=atol)
    assert_state_close(model, ref, rtol=rtol, atol=atol)
    return g, ref


def _detached(tree):
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), tree)


def _tokens(n=2, batch=2, seq=10, vocab=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (t, t) for t in (torch.randint(1, vocab, (batch, seq), generator=gen) for _ in range(n))
    ]


def _hooks(model: nn.Module) -> list:
    return [(n, list(m._forward_hooks.values())) for n, m in model.named_modules()]


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


# -- transformers' output capturing --------------------------------------------------------------


def _mixtral():
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
        router_aux_loss_coef=0.05,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).train()


def _moe_loss(model, x, y):
    out = model(input_ids=x, labels=y, output_router_logits=True)
    return out.loss, out.aux_loss


@pytest.mark.parametrize("warm_up", [False, True], ids=["first-call", "after-eager-warm-up"])
def test_mixtral_load_balancing_loss_trains_like_eager(warm_up):
    """output_router_logits=True: transformers installs forward hooks on the routers on first
    use and sets _output_capturing_hooks_installed; the hooks collect the router logits the
    auxiliary loss is computed from. Traced, on the first call or after an eager warm-up; the
    model is left with the hooks and the flag, as eager leaves it; one compiled step."""
    model = _mixtral()
    if warm_up:
        _quiet(lambda: model(input_ids=_tokens(1)[0][0], output_router_logits=True))
    g, ref = _train_like_eager(model, _moe_loss, _tokens(2))
    assert len(g.compiled_steps) == 1
    assert vars(model.model)["_output_capturing_hooks_installed"] is True
    assert _hook_count(model) == _hook_count(ref) > 0


def test_a_failed_build_puts_back_the_hooks_and_flags_transformers_installed(monkeypatch):
    """The settled state (hooks, the flag) is undone when a later stage fails: the model is as
    it was before the call."""
    model = _mixtral()
    hooks = _hooks(model)
    monkeypatch.setattr(torch._dynamo, "lookup_backend", lambda name: _broken_compiler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, y):
        loss, aux = _moe_loss(self.model, x, y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    with pytest.raises(graphamp.CompileError):
        _quiet(lambda: g(*_tokens(1)[0]))
    assert "_output_capturing_hooks_installed" not in vars(model.model)
    assert _hooks(model) == hooks


def _broken_compiler(gm, example):
    raise RuntimeError("no backend today")


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
    )
    config._attn_implementation = "eager"  # attention weights exist only in the eager kernel
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def _loss_and_hidden_states(model, x, y):
    out = model(input_ids=x, labels=y, output_hidden_states=True, output_attentions=True)
    return out.loss, (out.hidden_states, out.attentions)


def test_hidden_states_and_attentions_asked_for_train_like_eager():
    """output_hidden_states / output_attentions: the tensors the hooks collect are returned
    from build() and equal eager's."""
    g, _ = _train_like_eager(_llama(), _loss_and_hidden_states, _tokens(2))
    hidden, attentions = _quiet(lambda: g(*_tokens(1)[0]))[1]
    assert len(hidden) == 3 and len(attentions) == 2


def test_segformer_trains_like_eager():
    """SegformerForSemanticSegmentation asks its encoder for every stage's hidden states (the
    decode head fuses them): transformers' capturing hooks, traced."""
    config = transformers.SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        num_attention_heads=[1, 2],
        patch_sizes=[7, 3],
        strides=[4, 2],
        mlp_ratios=[2, 2],
        decoder_hidden_size=16,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    torch.manual_seed(0)
    model = transformers.SegformerForSemanticSegmentation(config).train()
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(2, 3, 32, 32, generator=gen), torch.randint(0, 3, (2, 32, 32), generator=gen))
        for _ in range(2)
    ]

    def loss_of(m, x, y):
        out = m(pixel_values=x, labels=y)
        return out.loss, out.logits

    _train_like_eager(model, loss_of, batches)


# -- caches built on first use --------------------------------------------------------------------


def test_phi3_longrope_cache_built_on_first_use_trains_like_eager():
    """Phi-3 with longrope keeps long_inv_freq as a plain tensor attribute built on first use
    (from the config alone) and reads it on every call. After the first call it holds eager's
    values."""
    config = transformers.Phi3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 4,
            "original_max_position_embeddings": 16,
            "factor": 4.0,
        },
    )
    torch.manual_seed(0)
    model = _quiet(lambda: transformers.Phi3ForCausalLM(config).train())
    rotary = model.model.rotary_emb
    assert "long_inv_freq" not in vars(rotary)

    def loss_of(m, x, y):
        return m(input_ids=x, labels=y).loss, ()

    g, ref = _train_like_eager(model, loss_of, _tokens(2))
    assert len(g.compiled_steps) == 1
    torch.testing.assert_close(vars(rotary)["long_inv_freq"], ref.model.rotary_emb.long_inv_freq)


class LazyRotary(nn.Module):
    """The rotary cache of GPT-NeoX-style code: built, and grown, on first use."""

    def __init__(self, as_buffer: bool):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.as_buffer = as_buffer
        self.max_seq_len_cached = 0
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(8) / 8), persistent=False)
        if not as_buffer:
            self.cos_cached = None

    def _set_cache(self, n: int) -> None:
        self.max_seq_len_cached = n
        angles = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None]
        if self.as_buffer:
            self.register_buffer("cos_cached", angles.cos(), persistent=False)
        else:
            self.cos_cached = angles.cos()

    def forward(self, x):
        if x.shape[1] > self.max_seq_len_cached:
            self._set_cache(x.shape[1])
        return self.lin(x) * self.cos_cached[: x.shape[1]]


@pytest.mark.parametrize("as_buffer", [False, True], ids=["attribute", "buffer"])
def test_a_rotary_cache_built_on_first_use_trains_like_eager(as_buffer):
    """The cache is computed once, from the buffer, as eager's first call computes it; the
    compiled step reads it; afterwards the module holds eager's cache and size. A longer
    sequence grows it, as in eager."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)

    def batches(seq):
        return [(torch.randn(2, seq, 8, generator=gen), torch.randn(2, seq, 8, generator=gen))]

    def loss_of(m, x, y):
        out = m(x)
        return F.mse_loss(out, y), out

    model = LazyRotary(as_buffer)
    g, ref = _train_like_eager(model, loss_of, batches(5) * 2)
    assert model.max_seq_len_cached == ref.max_seq_len_cached == 5
    torch.testing.assert_close(model.cos_cached, ref.cos_cached)
    assert ("cos_cached" in model._buffers) is as_buffer
    assert len(g.compiled_steps) == 1


def test_a_cache_an_eager_call_built_before_the_first_call_is_read_as_a_constant():
    """An eager forward filled the cache before g(...): capture lifts the tensor attribute as
    a live constant (its placeholder named after the attribute path: no SyntaxError from
    torch's code generation, which a dotted name raised) and trains as eager."""
    torch.manual_seed(0)
    model = LazyRotary(as_buffer=False)
    model(torch.randn(2, 5, 8))
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen))] * 2

    def loss_of(m, x, y):
        out = m(x)
        return F.mse_loss(out, y), out

    g, ref = _train_like_eager(model, loss_of, batches)
    assert len(g.compiled_steps) == 1


@pytest.mark.parametrize("as_buffer", [False, True], ids=["attribute", "buffer"])
def test_a_rotary_cache_grown_over_changing_lengths_equals_eager_and_compiles_twice(as_buffer):
    """Dynamic shapes: the second length makes the sequence dimension symbolic. The cache is
    grown as eager's call grows it (its size is that call's length, computed for real), and the
    dynamic step assumes the grown cache: every length up to it reuses that step, with the
    cache eager keeps. A longer sequence grows it again: one more build, as eager grows it."""
    torch.manual_seed(0)
    model = LazyRotary(as_buffer)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    gen = torch.Generator().manual_seed(0)

    def train(lengths):
        for n in lengths:
            x, y = torch.randn(2, n, 8, generator=gen), torch.randn(2, n, 8, generator=gen)
            loss = g(x, y)
            ref_opt.zero_grad(set_to_none=True)
            ref_loss = F.mse_loss(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        assert_state_close(model, ref, rtol=1e-5, atol=1e-6)
        assert model.max_seq_len_cached == ref.max_seq_len_cached == max(lengths)
        torch.testing.assert_close(model.cos_cached, ref.cos_cached)
        assert ("cos_cached" in model._buffers) is as_buffer

    train([5, 9, 4, 7, 9, 3])
    static, dynamic = g.compiled_steps
    assert static.dynamic == () and dynamic.dynamic == ((0, 1), (1, 1)) and dynamic.calls == 5
    train([12, 6])
    assert [step.calls for step in g.compiled_steps] == [1, 5, 2]


class KeepsTheLength(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.length = x.shape[0]  # fails: length
        return self.lin(x)


def test_a_size_stored_on_every_call_is_refused_once_the_size_is_symbolic():
    """A static step rewrites the same length on every call (nothing to replay); the dynamic
    step of the second size would have to store a different one on each call: refused by name,
    and the model keeps what the last call left."""
    model = KeepsTheLength()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    g(torch.randn(2, 4), torch.randn(2, 4))
    assert model.length == 2
    with pytest.raises(CaptureError, match=r"self\.model\.length .*a size of g\(\.\.\.\)'s inputs"):
        g(torch.randn(3, 4), torch.randn(3, 4))
    assert model.length == 2 and g.step_count == 1
    g.config.set_dynamic_shapes(False)  # a step per size: each one stores its own
    g(torch.randn(3, 4), torch.randn(3, 4))
    assert model.length == 3 and len(g.compiled_steps) == 2
    g(torch.randn(2, 4), torch.randn(2, 4))  # the first step again: it stores its length
    assert model.length == 2 and len(g.compiled_steps) == 2


class KeepsItsPyramid(nn.Module):
    """RAFT's pattern: a table computed from this call's features, kept on the module and read
    back later in the same forward (torchvision's CorrBlock.build_pyramid / index_pyramid)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 6)
        self.pyramid = [torch.tensor(0.0)]

    def forward(self, x):
        f = self.enc(x)
        self.pyramid = [f]
        for _ in range(2):
            self.pyramid.append(self.pyramid[-1][:, ::2])
        return sum(level.sum(1) for level in self.pyramid)


def test_a_table_kept_on_the_module_and_read_in_the_same_forward_trains_like_eager():
    """Written on every call from the batch: the step outputs the tensors and graphamp puts
    them on the module after each call, as eager leaves them."""
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 6, generator=gen), torch.randn(4, generator=gen)) for _ in range(3)]

    def loss_of(m, x, y):
        out = m(x)
        return F.mse_loss(out, y), out

    model = KeepsItsPyramid()
    # the outputs sum strided views, which eager and the step add in different orders: on some
    # CPUs an output was 8e-6 (7e-5 relative) from eager's, both in float32
    g, ref = _train_like_eager(model, loss_of, batches, rtol=1e-4, atol=1e-5)
    assert [type(t) for t in model.pyramid] == [torch.Tensor] * 3
    for mine, theirs in zip(model.pyramid, ref.pyramid):
        torch.testing.assert_close(mine, theirs.detach())
    assert len(g.compiled_steps) == 1


def test_with_gradient_accumulation_the_table_is_the_last_micro_batchs():
    model = KeepsItsPyramid()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss

    g = make_graph(
        model,
        None,
        opt,
        build=build,
        configure=lambda g: g.config.set_gradient_accumulation_steps(2),
    )
    x, y = torch.randn(4, 6), torch.randn(4)
    before = copy.deepcopy(model)
    g(x, y)
    torch.testing.assert_close(model.pyramid[0], before.enc(x[2:]).detach())


def test_the_precision_report_leaves_no_fake_tensor_behind():
    """The autocast oracle runs build() again: what it writes is put back."""
    model = KeepsItsPyramid()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build, amp=torch.bfloat16)
    g(torch.randn(4, 6), torch.randn(4))
    kept = list(model.pyramid)
    g.precision_report()
    assert all(a is b for a, b in zip(model.pyramid, kept))


@pytest.mark.slow
def test_torchvision_raft_trains_like_eager():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.optical_flow.raft_small(weights=None).train()
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(1, 3, 128, 128, generator=gen), torch.randn(1, 3, 128, 128, generator=gen))
        for _ in range(2)
    ]

    def loss_of(m, a, b):
        flows = m(a, b, num_flow_updates=2)
        return sum(f.abs().mean() for f in flows), flows[-1]

    g, ref = _train_like_eager(model, loss_of, batches, lr=0.01, rtol=1e-4, atol=1e-5)
    mine, theirs = model.corr_block.corr_pyramid, ref.corr_block.corr_pyramid
    assert [t.shape for t in mine] == [t.shape for t in theirs]
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=1e-4)


# -- what cannot be replayed ----------------------------------------------------------------------


class Writes(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how
        self.ema = torch.zeros(())
        self.calls = 0

    def forward(self, x):
        if self.how == "ema":
            self.ema = 0.9 * self.ema + 0.1 * self.lin.weight.mean()  # fails: ema
        elif self.how == "batch-read-back":
            if not hasattr(self, "first"):
                self.first = x.detach()  # fails: batch-read-back
            return self.lin(x) + self.first.sum()
        elif self.how == "hook":
            self.lin.register_forward_hook(lambda m, a, o: o * 2)  # fails: hook
        elif self.how == "counter":
            self.calls += 1  # fails: counter
        elif self.how == "parameter" and not hasattr(self, "extra"):
            self.extra = nn.Parameter(torch.ones(4))  # fails: parameter
        return self.lin(x)


_REFUSED = {
    "counter": r"self\.model\.calls .*changes it on every call \(1 after the first call, 2 after",
    "ema": r"self\.model\.ema .*reads the tensor and writes a new one on every call.*buffer",
    "batch-read-back": r"self\.model\.first .*one call's inputs that the next call reads back",
    "hook": r"registers the forward hook .*on self\.model\.lin",
    "parameter": r"registers a parameter self\.model\.extra .*__init__",
}


@pytest.mark.parametrize("how", sorted(_REFUSED))
def test_what_cannot_be_replayed_is_refused_by_name_and_put_back(how):
    model = Writes(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    before_vars, hooks, state = dict(vars(model)), _hooks(model), snapshot(model, opt)
    with pytest.raises(CaptureError, match=_REFUSED[how]) as info:
        g(torch.randn(2, 4), torch.randn(2, 4))
    line = next(
        i
        for i, text in enumerate(open(__file__).read().splitlines(), 1)
        if text.endswith(f"# fails: {how}")
    )
    assert f"test_side_effects.py:{line}" in str(info.value)
    assert vars(model).keys() == before_vars.keys()
    assert all(vars(model)[k] is v for k, v in before_vars.items())
    assert _hooks(model) == hooks
    assert_unchanged(state, model, opt)
    assert g.step_count == 0
    # calling again refuses the same way: no second, cryptic error from what the first left
    with pytest.raises(CaptureError, match=_REFUSED[how]):
        g(torch.randn(2, 4), torch.randn(2, 4))
    assert_unchanged(state, model, opt)


def test_a_transformers_config_written_on_the_first_call_settles_without_another_compile():
    """BertForSequenceClassification sets ``config.problem_type`` on its first call: the write
    is settled like a module attribute's, so the step compiles once and the config is what
    eager leaves."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForSequenceClassification(config)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)

    def build(self, ids, labels):
        loss = self.model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids, labels = (
            torch.randint(0, 64, (4, 8), generator=gen),
            torch.randint(0, 3, (4,), generator=gen),
        )
        got = g(ids, labels)
        twin_opt.zero_grad()
        want = twin(input_ids=ids, labels=labels).loss
        want.backward()
        twin_opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    assert len(g.compiled_steps) == 1
    assert model.config.problem_type == twin.config.problem_type == "single_label_classification"
    assert_state_close(model, twin)


LOGGED: list = []


def test_a_tensor_put_into_a_global_list_is_refused_and_the_list_left_as_it_was():
    """LOGGED.append(out) in build(): the compiled step would never put its tensors there (the
    list kept a placeholder of the capture, silently). Refused by name, the list as before."""
    import torch.nn.functional as F
    from helpers import make_graph

    import graphamp

    model = torch.nn.Linear(4, 2)
    LOGGED[:] = ["kept"]

    def build(self, x, y):
        out = self.model(x)
        LOGGED.append(out.detach())
        loss = F.mse_loss(out, y)
        loss.backward()
        return loss

    g = make_graph(model, None, torch.optim.SGD(model.parameters(), lr=0.1), build=build)
    with pytest.raises(graphamp.CaptureError, match=r"global LOGGED .*assign it to an attribute"):
        g(torch.randn(3, 4), torch.randn(3, 2))
    assert LOGGED == ["kept"]
