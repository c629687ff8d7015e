"""The optimizer update of repeated blocks, one kernel per distinct block (issue 40,
``config.set_block_updates``).

With it on, each outlined block that has an equal gets one ``graphamp::update_block_`` call; the
step must train bitwise like the inlined step (the same math on a subset of the same lists),
through skipped steps and momentum that starts from the first gradient, and under inductor the
kernel compiled once must compute what the eager math does.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn as nn
from helpers import assert_bitwise, make_graph
from models import TinyGPT, lm_loss

import graphamp
from graphamp.step import block_update
from graphamp.step.block_update import block_of, numbered_blocks, spec_text
from graphamp.step.update_math import GroupTensors

# the models here are tiny: outlined as a model whose blocks do enough work is by default
pytestmark = pytest.mark.usefixtures("outline_small_blocks")

UPDATE_BLOCK = torch.ops.graphamp.update_block_.default


def _update_calls(g) -> list:
    """The step's ``update_block_`` nodes (auto-functionalized: the op is the first argument)."""
    graph = g.compiled_steps[-1].step_graph.graph
    return [n for n in graph.nodes if n.args and n.args[0] is UPDATE_BLOCK]


def _tokens(gen):
    idx = torch.randint(0, 64, (4, 17), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def _run(outline: bool, make_opt, steps: int = 3, **graph_options):
    """A 3-block TinyGPT trained ``steps`` steps from seed 0: (graph, losses, state, moments);
    ``outline``: blocks outlined and their updates by one kernel each, else the step inlined."""

    def configure(g):
        g.config.set_outline_blocks(outline)
        g.config.set_block_updates(outline)

    torch.manual_seed(0)
    model = TinyGPT(layers=3)
    opt = make_opt(model)
    g = make_graph(
        model,
        lm_loss,
        opt,
        configure=configure,
        **graph_options,
    )
    gen = torch.Generator().manual_seed(1)
    losses = [g(*_tokens(gen)).detach().clone() for _ in range(steps)]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return g, losses, state, moments


@pytest.mark.slow
def test_by_default_blocks_repeated_three_times_get_the_calls_and_the_choice_is_keyed():
    """On the CPU (outlined by default) blocks repeated at least 3 times are updated by one
    call each; a pair is not (two calls cost ResNet-18 2% of its step and save one block's
    update at compile). ``True`` takes pairs too, ``False`` none; changing it builds again,
    and every choice trains bitwise alike."""
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)  # noqa: E731

    def run(layers: int, mode: bool | None):
        torch.manual_seed(0)
        model = TinyGPT(layers=layers)
        configure = (lambda g: g.config.set_block_updates(mode)) if mode is not None else None
        g = make_graph(model, lm_loss, adamw(model), amp=torch.bfloat16, configure=configure)
        gen = torch.Generator().manual_seed(1)
        losses = [g(*_tokens(gen)).detach().clone() for _ in range(2)]
        return g, (losses, {k: v.clone() for k, v in model.state_dict().items()})

    g, default3 = run(3, None)
    assert g.config.block_updates is None and len(_update_calls(g)) == 3
    g.config.set_block_updates(False)
    g(*_tokens(torch.Generator().manual_seed(1)))
    assert len(g.compiled_steps) == 2 and _update_calls(g) == []
    assert_bitwise(default3, run(3, False)[1])
    g, default2 = run(2, None)
    assert _update_calls(g) == []
    g, asked2 = run(2, True)
    assert len(_update_calls(g)) == 2
    assert_bitwise(default2, asked2)


@pytest.mark.slow
def test_block_updates_run_on_inlined_blocks_and_where_the_default_has_none():
    """Block updates need no outlining: a step the default gives none (gradient accumulation
    here, CUDA alike) gets them when asked, its blocks inlined as by default, and so does a
    step with set_outline_blocks(False); both train bitwise like the plain inlined update."""

    def run(block_updates: bool, outline: bool | None = None):
        torch.manual_seed(0)
        model = TinyGPT(layers=3)

        def configure(g):
            g.config.set_gradient_accumulation_steps(2)
            g.config.set_block_updates(block_updates)
            if outline is not None:
                g.config.set_outline_blocks(outline)

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = make_graph(model, lm_loss, opt, amp=torch.bfloat16, configure=configure)
        gen = torch.Generator().manual_seed(1)
        losses = [g(*_tokens(gen)).detach().clone() for _ in range(2)]
        return g, losses, {k: v.clone() for k, v in model.state_dict().items()}

    inlined, (g, *asked) = run(False), run(True)
    assert _update_calls(inlined[0]) == [] and len(_update_calls(g)) == 3
    assert "outline" not in g.compiled_steps[-1].timings  # accumulation: blocks inlined
    assert_bitwise(inlined[1:], asked)
    g, *inline_asked = run(True, outline=False)
    assert len(_update_calls(g)) == 3 and "outline" not in g.compiled_steps[-1].timings
    assert_bitwise(inlined[1:], inline_asked)


def test_the_default_gives_inlined_blocks_update_calls_where_their_work_pays(monkeypatch):
    """Blocks too small to outline by default (step/block_work.py) are inlined, and still get
    one update call each where they do enough work for the calls to cost under 2%; where they
    do not, the update stays one multi-tensor run. Both train bitwise alike."""
    import graphamp.step.block_work as block_work

    monkeypatch.setattr(block_work, "OUTLINE_MIN_FLOPS_PER_BLOCK", float("inf"))

    def run(update_threshold: float):
        monkeypatch.setattr(block_work, "BLOCK_UPDATE_MIN_FLOPS_PER_BLOCK", update_threshold)
        torch.manual_seed(0)
        model = TinyGPT(layers=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = make_graph(model, lm_loss, opt, amp=torch.bfloat16)
        gen = torch.Generator().manual_seed(1)
        losses = [g(*_tokens(gen)).detach().clone() for _ in range(2)]
        assert "outline" not in g.compiled_steps[-1].timings  # inlined by default
        return g, losses, {k: v.clone() for k, v in model.state_dict().items()}

    (paying, *calls), (small, *plain) = run(0.0), run(float("inf"))
    assert len(_update_calls(paying)) == 3 and _update_calls(small) == []
    assert_bitwise(calls, plain)


def test_block_of_names_the_outermost_numbered_module():
    assert block_of("transformer.h.3.attn.c_attn.weight") == (
        "transformer.h.3",
        "attn.c_attn.weight",
    )
    assert block_of("layer1.0.conv1.weight") == ("layer1.0", "conv1.weight")
    assert block_of("blocks.2.mlp.0.weight") == ("blocks.2", "mlp.0.weight")
    assert block_of("wte.weight") is None
    assert block_of("0.weight") is None  # a Sequential's own layers: no parent, no block
    # torchvision's ViT names its layers; ln_1 is a layer of one, not a block
    vit = "encoder.layers.encoder_layer_3.ln_1.weight"
    assert block_of(vit) == ("encoder.layers.encoder_layer_3", "ln_1.weight")
    assert numbered_blocks("encoder.layers.encoder_layer_3.mlp.0.weight") == [
        ("encoder.layers.encoder_layer_3", "mlp.0.weight"),
        ("encoder.layers.encoder_layer_3.mlp.0", "weight"),
    ]


def test_blocks_inside_stages_without_an_equal_get_the_calls(monkeypatch):
    """Stages of different widths have no equal; the blocks inside each do, as outlining
    finds them. Where some outer block has an equal, nothing inside the others is taken."""
    calls = []
    monkeypatch.setattr(block_update, "_call", lambda *args: calls.append(args[-1]))

    def left(names, widths):
        params = [torch.zeros(w) for w in widths]
        t = GroupTensors(params, params, {}, {})
        return block_update.update_repeated_blocks("sgd", {}, [], [], t, None, None, names)

    staged = [f"stages.{s}.blocks.{b}.w" for s in range(2) for b in range(2)] + ["head.w"]
    assert left(staged, [4, 4, 8, 8, 2]) == [4]
    assert calls == [[0], [1], [2], [3]]
    calls.clear()
    # layers.0 and layers.1 are equal, layers.2 is not: its inner run stays inline
    flat = ["layers.0.w", "layers.1.w", "layers.2.mlp.0.w", "layers.2.mlp.1.w"]
    assert left(flat, [4, 4, 4, 4]) == [2, 3]
    assert calls == [[0], [1]]


def test_each_block_is_one_call_of_one_kernel_and_bitwise_the_inlined_update(caplog):
    """AdamW with bf16 AMP: 3 calls of one kernel; the bf16 gradients of the blocks' matrices
    reach the kernel uncast (it upcasts them in its loop, as the inlined update's loop does)."""
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)  # noqa: E731
    inlined = _run(False, adamw, amp=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="graphamp"):
        outlined = _run(True, adamw, amp=torch.bfloat16)
    assert_bitwise(inlined[1:], outlined[1:])
    assert _update_calls(inlined[0]) == []
    calls = _update_calls(outlined[0])
    assert len(calls) == 3 and len({n.kwargs["spec"] for n in calls}) == 1
    lines = [r.getMessage() for r in caplog.records if ": assemble " in r.getMessage()]
    assert any("the update of 3 blocks by 1 kernel)" in line for line in lines), lines
    grads = [g.meta["val"] for n in calls for g in n.kwargs["grads"]]
    matrices = [g for g in grads if g.dim() == 2]
    assert matrices and all(g.dtype == torch.bfloat16 for g in matrices)
    # the spec names each input's dtype as the kernel gets it
    spec = json.loads(calls[0].kwargs["spec"])
    n = spec["n"]
    assert [d for d, _, _ in spec["inputs"][n : 2 * n]] == [str(g.dtype) for g in grads[:n]]


@pytest.mark.slow
def test_skipped_steps_and_momentum_started_from_the_gradient_are_bitwise_the_inlined_ones():
    """SGD with dampening (each buffer starts as a copy of its first gradient: the update's
    per-parameter start flags are written by the kernel too) and weight decay, fp16 with a
    scaler that starts too high and grows every step, so some steps overflow and are skipped."""

    def sgd(m):
        return torch.optim.SGD(
            m.parameters(), lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-4
        )

    def run(outline: bool):
        scaler = graphamp.GradScaler(init_scale=2.0**16, growth_interval=1)
        return _run(outline, sgd, steps=6, amp=torch.float16, scaler=scaler)

    inlined, outlined = run(False), run(True)
    assert_bitwise(inlined[1:], outlined[1:])
    skipped = outlined[0].history.fetch()["skipped"]
    assert 0.0 < sum(skipped) < len(skipped), skipped  # both kinds of step happened
    assert len(_update_calls(outlined[0])) == 3


@pytest.mark.slow
def test_blocks_split_over_param_groups_get_a_call_per_group_and_block():
    """nanoGPT's groups: weight decay for matrices, none for vectors; each group updates its
    part of every block."""

    def groups(m):
        params = list(m.parameters())
        return torch.optim.AdamW(
            [
                {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=1e-2,
        )

    inlined, outlined = _run(False, groups, 2), _run(True, groups, 2)
    assert_bitwise(inlined[1:], outlined[1:])
    calls = _update_calls(outlined[0])
    assert len(calls) == 6 and len({n.kwargs["spec"] for n in calls}) == 2


class _Uneven(nn.Module):
    """Two blocks of one width and one of another: the pair shares a kernel, the odd block is
    updated inline."""

    def __init__(self):
        super().__init__()
        widths = (8, 8, 12)
        self.blocks = nn.ModuleList(nn.Linear(8, w) for w in widths)
        self.head = nn.Linear(sum(widths), 2)

    def forward(self, x):
        return self.head(torch.cat([b(x) for b in self.blocks], dim=-1))


def test_a_block_without_an_equal_is_updated_inline():
    torch.manual_seed(0)
    model = _Uneven()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    g = make_graph(
        model, nn.functional.mse_loss, opt, configure=lambda g: g.config.set_block_updates(True)
    )
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    g(x, y)
    calls = _update_calls(g)
    assert len(calls) == 2
    for node in calls:
        spec = json.loads(node.kwargs["spec"])
        assert [sizes for _, sizes, _ in spec["inputs"][: spec["n"]]] == [[8, 8], [8]]


@pytest.mark.inductor
def test_the_compiled_kernel_computes_what_the_eager_math_does():
    """One block's AdamW update (amsgrad, bf16 gradients, a skipped step between two taken
    ones), compiled by inductor, against the same op run eagerly."""
    shapes = [(16, 8), (16,), (8, 16), (8,)]

    def tensors():
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
        grads = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
        # key by key: the steps, then exp_avg, exp_avg_sq and max_exp_avg_sq of every tensor
        states = [torch.zeros(()) for _ in shapes] + [torch.zeros(s) for s in shapes * 3]
        hypers = [torch.tensor(v) for v in (1e-2, 0.9, 0.999, 1e-8, 0.1)]
        return params, grads, states, hypers

    flags = {"amsgrad": True, "decoupled": True, "weight_decay": True, "maximize": False}
    keys = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    names = ("lr", "beta1", "beta2", "eps", "weight_decay")
    results = {}
    for backend in ("eager", "inductor"):
        params, grads, states, hypers = tensors()
        for skip in (False, True, False):
            skip_t = torch.tensor(skip)
            flat = [*params, *grads, *states, *hypers, skip_t]
            spec = json.loads(
                spec_text("adam", {**flags, "fused": None}, keys, names, len(shapes), False, flat)
            )
            spec["backend"] = backend
            UPDATE_BLOCK(
                params, grads, states, [], hypers, skip_t, json.dumps(spec, sort_keys=True)
            )
        results[backend] = [t.detach().clone() for t in (*params, *states)]
    for a, b in zip(results["eager"], results["inductor"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
