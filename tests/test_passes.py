"""Structure tests of the AMP passes, one small graph per colouring rule and per cast rule.

Graphs come from tiny functions traced with make_fx on fake tensors (so every node carries the
fake value the passes read). Colouring tests use small explicit lists, so each rule is tested
alone: allow {mm}, deny {exp, sum}, infer {add, mul}, clear {view, relu, t}.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from graphamp import passes
from graphamp.passes import AmpContext, PrecisionLists, run_amp_passes
from graphamp.passes.lint import AmpInvariantError, check_amp_invariants
from graphamp.torchkit.fxutil import op_name

aten = torch.ops.aten
SMALL = PrecisionLists(
    allow=frozenset({aten.mm}),
    deny=frozenset({aten.exp, aten.sum}),
    infer=frozenset({aten.add, aten.mul}),
    clear=frozenset({aten.view, aten.relu, aten.t}),
)


def trace(fn, *args) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)


def colour(fn, *args, lists=SMALL, **ctx) -> dict[str, str]:
    gm = trace(fn, *args)
    passes.colour_by_lists(gm, AmpContext(lists=lists, **ctx))
    return {n.name: n.meta.get("amp_colour") for n in gm.graph.nodes if n.op == "call_function"}


def amp(fn, *args, lists=SMALL, dtype=torch.float16, **ctx):
    gm = trace(fn, *args)
    context = AmpContext(lists=lists, dtype=dtype, **ctx)
    gm = run_amp_passes(gm, context)
    return gm, context


def casts(gm) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.meta.get("amp_cast")]


X = torch.randn(4, 4)
W = torch.randn(4, 4)


# -- colouring rules ------------------------------------------------------------------------------


def test_allow_ops_run_low_and_deny_ops_run_fp32():
    c = colour(lambda x, w: torch.exp(torch.mm(x, w)), X, W)
    assert c == {"mm": "allow", "exp": "deny"}


def test_deny_spreads_downstream_through_infer_ops():
    c = colour(lambda x, w: torch.mm(torch.exp(x) + 1, w), X, W)
    assert c["add"] == "deny"


def test_deny_does_not_spread_through_a_clear_op_that_feeds_only_allow_ops():
    # exp -> view -> mm: the view leads to no deny/infer op, so it may join the mm (upward)
    c = colour(lambda x, w: torch.mm(torch.exp(x).view(4, 4), w), X, W)
    assert c["view"] == "allow" and c["exp"] == "deny"


def test_deny_spreads_through_a_clear_op_that_leads_to_an_infer_op():
    c = colour(lambda x, w: torch.mm(torch.exp(x).view(4, 4) * 2, w), X, W)
    assert c["view"] == "deny" and c["mul"] == "deny"


def test_infer_between_allow_ops_runs_low():
    c = colour(lambda x, w: torch.mm(torch.mm(x, w) * 2 + 1, w), X, W)
    assert c["mul"] == "allow" and c["add"] == "allow"


def test_infer_after_an_allow_op_feeding_only_fp32_ops_stays_fp32():
    c = colour(lambda x, w: torch.exp(torch.mm(x, w) * 2), X, W)
    assert c["mul"] == "deny"


def test_infer_from_an_allow_op_to_a_graph_output_runs_low():
    c = colour(lambda x, w: torch.mm(x, w) * 2, X, W)
    assert c["mul"] == "allow"


def test_clear_op_joins_low_precision_producers_downward():
    c = colour(lambda x, w: torch.exp(torch.mm(x, w).view(16)), X, W)
    assert c["view"] == "allow"


def test_clear_op_joins_low_precision_consumers_upward():
    c = colour(lambda x, w: torch.mm(x.view(4, 4), w), X, W)
    assert c["view"] == "allow"


def test_clear_op_between_fp32_ops_stays_fp32():
    c = colour(lambda x: torch.exp(torch.exp(x).view(16)), X)
    assert c["view"] == "deny"


def test_unknown_ops_stay_fp32_and_are_reported():
    gm = trace(lambda x, w: torch.mm(torch.sin(torch.mm(x, w)), w), X, W)
    ctx = AmpContext(lists=SMALL)
    passes.colour_by_lists(gm, ctx)
    sin = next(n for n in gm.graph.nodes if op_name(n) == "aten.sin")
    assert sin.meta["amp_colour"] == "deny" and sin.meta["amp_list"] == "unknown"
    assert ctx.unknown_ops == {"aten.sin": 1}


def test_non_float_ops_are_not_coloured():
    c = colour(lambda x, i: torch.mm(x, x)[i + 1], X, torch.tensor([0, 1]))
    assert c["add"] is None  # integer arithmetic on indices


def test_tuple_outputs_take_their_producers_colour():
    def fn(x, w):
        values, _ = torch.mm(x, w).max(dim=1)
        return torch.mm(values.view(2, 2), w[:2, :2])

    gm = trace(fn, X, W)
    passes.colour_by_lists(
        gm,
        AmpContext(
            lists=SMALL.with_overrides(
                type(
                    "O",
                    (),
                    {
                        "allow": (),
                        "deny": (),
                        "infer": (),
                        "clear": (aten.max, aten.slice),
                        "remove": (),
                    },
                )()
            )
        ),
    )
    for node in gm.graph.nodes:
        if node.target is operator.getitem:
            assert node.meta["amp_colour"] == node.args[0].meta["amp_colour"]


def test_user_casts_are_fixed_not_coloured():
    c = colour(lambda x, w: torch.mm(x.double(), w.double()), X, W)
    assert c["_to_copy"] == "fixed"


def test_pinned_module_paths_stay_fp32():
    gm = trace(lambda x, w: torch.mm(torch.mm(x, w), w), X, W)
    first = next(n for n in gm.graph.nodes if op_name(n) == "aten.mm")
    first.meta["nn_module_stack"] = {"model.head": ("model.head", "torch.nn.Linear")}
    passes.colour_by_lists(gm, AmpContext(lists=SMALL, pinned_paths=frozenset({"model.head"})))
    assert first.meta["amp_colour"] == "deny"
    assert "pinned" in first.meta["amp_reason"]


def test_precision_hints_force_the_colour_and_spread():
    import graphamp

    def fn(x, w):
        y = torch.mm(x, w)
        a = graphamp.full_precision(y * 2) + 1  # deny, spreads to the add
        b = graphamp.low_precision(x) * 3  # allow: the mul leads from it to an output
        return torch.mm(a, w), b

    from graphamp.capture import BuildRoot, capture_forward
    from graphamp.records.inputs import flatten_inputs

    root = BuildRoot({}, fn)
    cap = capture_forward(root, flatten_inputs((X, W), {}), "hints")
    lists = SMALL.with_overrides(
        type(
            "O",
            (),
            {
                "allow": (torch.ops.graphamp.low_precision,),
                "deny": (torch.ops.graphamp.full_precision,),
                "infer": (),
                "clear": (),
                "remove": (),
            },
        )()
    )
    ctx = AmpContext(lists=lists)
    gm = run_amp_passes(cap.gm, ctx)
    colours = {n.name: n.meta.get("amp_colour") for n in gm.graph.nodes}
    assert colours["add"] == "deny"  # downstream of the full_precision hint
    assert colours["mul_1"] == "allow"  # fed by the low_precision hint, to an output: low
    assert not any(
        n.target
        in (torch.ops.graphamp.low_precision.default, torch.ops.graphamp.full_precision.default)
        for n in gm.graph.nodes
    )  # hints are gone after the pipeline


def test_opt_levels_o2_and_o3():
    fn = lambda x, w: torch.exp(torch.mm(x, w) * 2)  # noqa: E731
    o1 = colour(fn, X, W)
    o2 = colour(fn, X, W, opt_level="O2")
    o3 = colour(fn, X, W, opt_level="O3")
    assert (o1["mul"], o1["exp"]) == ("deny", "deny")
    assert (o2["mul"], o2["exp"]) == ("allow", "deny")  # all but deny ops
    assert (o3["mul"], o3["exp"]) == ("allow", "allow")  # everything


def test_overlapping_lists_are_a_value_error():
    with pytest.raises(ValueError, match="overlap.*aten.mm"):
        PrecisionLists(allow=frozenset({aten.mm}), deny=frozenset({aten.mm}))


def test_default_lists_are_disjoint_and_follow_autocast_where_it_lists_ops():
    d = passes.DEFAULT_LISTS
    assert aten.mm in d.allow and aten.convolution in d.allow and aten.bmm in d.allow
    for op in (
        aten._softmax,
        aten._log_softmax,
        aten.native_layer_norm,
        aten.sum,
        aten.exp,
        aten.nll_loss_forward,
        aten.mse_loss,
        aten.pow,
    ):
        assert op in d.deny, op
    assert aten.mean in d.infer and aten.var in d.deny  # documented differences
    assert aten.view in d.clear and aten.gelu in d.infer


# -- cast rules ---------------------------------------------------------------------------------


def test_one_cast_per_value_per_dtype():
    gm, _ = amp(lambda x, w: torch.mm(x, w) + torch.mm(x, w.t()), X, W)
    sources = sorted(c.args[0].name for c in casts(gm))
    assert sources == ["add", "w_1", "x_1"]  # x and w once although used twice; add -> output


def test_parameters_are_cast_once_then_hoisted_into_shadow_inputs():
    gm, ctx = amp(lambda x, w: torch.mm(torch.mm(x, w), w), X, W, parameters=frozenset({"w_1"}))
    shadows = [n for n in gm.graph.nodes if n.meta.get("shadow_of")]
    assert [s.meta["shadow_of"] for s in shadows] == ["w_1"]
    assert ctx.hoisted == [("w_1", torch.float16)]
    assert len(shadows[0].users) == 2 and not any(c.args[0].name == "w_1" for c in casts(gm))


def test_cast_chains_fold():
    # the user's x.half().float() on an fp32 value disappears
    gm, _ = amp(lambda x: torch.exp(x.half().float()), X)
    assert not any(n.target is aten._to_copy.default for n in gm.graph.nodes)
    # fp16 -> fp32 (user) -> fp16 (for the mm) folds to the fp16 value itself
    gm, _ = amp(lambda x, w: torch.mm(torch.mm(x, w).float(), w), X, W)
    mms = [n for n in gm.graph.nodes if op_name(n) == "aten.mm"]
    assert mms[1].args[0] is mms[0]


def test_integer_and_bool_tensors_are_never_cast():
    def fn(x, w, idx, mask):
        y = torch.mm(x, w)
        return torch.where(mask, y, 0.0)[idx] * 2

    gm, _ = amp(fn, X, W, torch.tensor([0, 2]), torch.rand(4, 4) > 0.5)
    for c in casts(gm):
        assert c.args[0].meta["val"].dtype.is_floating_point


def test_outputs_and_losses_come_back_in_fp32():
    def fn(x, w):
        y = torch.mm(x, w)
        return y, torch.sum(y)

    gm, _ = amp(fn, X, W)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert out[0].meta.get("amp_cast") and out[0].meta["amp_dtype"] == torch.float32
    assert passes.dtype_after_amp(out[1]) == torch.float32


def test_fp32_elementwise_op_reads_a_low_precision_input_without_a_cast():
    # exp(x) + mm(x, w): the add runs fp32 (deny spreads) and promotes the fp16 mm output itself
    gm, _ = amp(lambda x, w: torch.exp(x) + torch.mm(x, w), X, W)
    add = next(n for n in gm.graph.nodes if op_name(n) == "aten.add")
    assert not any(a.meta.get("amp_cast") for a in add.all_input_nodes)
    assert passes.dtype_after_amp(add) == torch.float32


def test_low_precision_factories_are_created_in_low_precision():
    lists = PrecisionLists(
        allow=frozenset({aten.mm}),
        deny=frozenset(),
        infer=frozenset({aten.add}),
        clear=frozenset({aten.ones}),
    )
    gm, _ = amp(lambda x, w: torch.mm(x, w) + torch.ones(4, 4), X, W, lists=lists)
    ones = next(n for n in gm.graph.nodes if op_name(n) == "aten.ones")
    assert ones.kwargs["dtype"] == torch.float16
    assert not any(c.args[0] is ones for c in casts(gm))


def test_batchnorm_keeps_parameters_and_statistics_fp32():
    def fn(x, w, weight, bias, mean, var):
        y = torch.nn.functional.conv2d(x, w)
        out = aten._native_batch_norm_legit_functional(y, weight, bias, mean, var, True, 0.1, 1e-5)
        return torch.nn.functional.conv2d(out[0].relu(), w), out[3], out[4]

    c = torch.ones(3)
    gm, _ = amp(
        fn, torch.randn(2, 3, 8, 8), torch.randn(3, 3, 1, 1), c, c, c, c, lists=passes.DEFAULT_LISTS
    )
    bn = next(n for n in gm.graph.nodes if "batch_norm" in op_name(n))
    assert bn.meta["amp_colour"] == "allow"
    assert not any(a.meta.get("amp_cast") for a in bn.args[1:5])
    assert passes.dtype_after_amp(bn) == (
        torch.float16,
        torch.float32,
        torch.float32,
        torch.float32,
        torch.float32,
    )


def test_fp64_values_are_never_lowered():
    gm, ctx = amp(
        lambda x, w: torch.mm(x, w), X.double(), W.double(), parameters=frozenset({"w_1"})
    )
    assert casts(gm) == []
    assert ctx.hoisted == []  # an fp64 parameter gets no low-precision shadow either


def test_bf16_works_like_fp16():
    gm, _ = amp(lambda x, w: torch.exp(torch.mm(x, w)), X, W, dtype=torch.bfloat16)
    assert {c.meta["amp_dtype"] for c in casts(gm)} == {torch.bfloat16, torch.float32}


def test_pass_dtype_bookkeeping_matches_what_the_ops_produce():
    def fn(x, w):
        y = torch.mm(x, w) * 2 + 1
        return torch.exp(y.view(16)).sum(), torch.mm(y.relu(), w)

    gm, _ = amp(fn, X, W, lists=passes.DEFAULT_LISTS)
    assert passes.verify_dtypes(gm) == []


def test_invariant_lint_catches_a_broken_graph():
    gm, _ = amp(lambda x, w: torch.exp(torch.mm(x, w)), X, W)
    cast = casts(gm)[0]
    with gm.graph.inserting_after(cast):
        dup = gm.graph.call_function(aten._to_copy.default, (cast.args[0],), dict(cast.kwargs))
    dup.meta.update(cast.meta)
    cast.replace_all_uses_with(dup, propagate_meta=False)
    dup.args = (cast.args[0],)
    # keep both alive
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((*out.args[0], cast),) if isinstance(out.args[0], tuple) else ((out.args[0], cast),)
    with pytest.raises(AmpInvariantError, match="has 2 casts"):
        check_amp_invariants(gm)


def test_every_pass_returns_a_pass_result_and_the_pipeline_is_one_tuple():
    assert [p.__name__ for p in passes.AMP_PIPELINE] == [
        "keep_fp32_where_faster",
        "colour_by_lists",
        "hoist_parameter_casts",
        "insert_casts",
        "remove_hints",
        "fold_cast_chains",
        "use_fp8_matmuls",
    ]
    gm = trace(lambda x, w: torch.mm(x, w), X, W)
    ctx = AmpContext(lists=passes.DEFAULT_LISTS)
    for amp_pass in passes.AMP_PIPELINE:
        result = amp_pass(gm, ctx)
        assert isinstance(result, passes.PassResult)
        gm = result.graph_module


# -- widening, promote, composite ops ------------------------------------------------

X16 = X.half()


def _node(gm, name):
    return next(n for n in gm.graph.nodes if op_name(n) == name)


def test_deny_op_widens_an_fp16_graph_input_and_the_output_comes_back_fp16():
    gm, _ = amp(lambda x: torch.exp(x), X16, lists=passes.DEFAULT_LISTS)
    exp = _node(gm, "aten.exp")
    assert passes.dtype_after_amp(exp) == torch.float32
    assert [c.meta["amp_dtype"] for c in casts(gm)] == [torch.float32, torch.float16]
    assert passes.verify_dtypes(gm) == []


def test_deny_op_widens_the_users_explicit_half_cast():
    # x.half() then sum: the sum runs in fp32; the user's round trip to fp16 is folded away
    gm, _ = amp(lambda x: torch.sum(x.half()), X, lists=passes.DEFAULT_LISTS)
    total = _node(gm, "aten.sum")
    assert total.args[0].op == "placeholder" and passes.dtype_after_amp(total) == torch.float32
    assert passes.verify_dtypes(gm) == []


def test_widening_spreads_downstream_and_each_value_is_cast_once():
    def fn(x):
        s = torch.sum(x, dim=0)  # deny: fp32
        return s * 2, torch.mm(s.view(1, 4), x.t())  # mul downstream of it; mm wants fp16

    gm, _ = amp(fn, X16, lists=passes.DEFAULT_LISTS)
    mul = _node(gm, "aten.mul")
    assert mul.meta["amp_widen"] and passes.dtype_after_amp(mul) == torch.float32
    # the sum's fp32 result is cast to fp16 once, shared by the mm and nothing else
    per_value = [(c.args[0].name, c.meta["amp_dtype"]) for c in casts(gm)]
    assert len(per_value) == len(set(per_value))
    assert passes.verify_dtypes(gm) == []


def test_fp64_is_never_widened_or_lowered():
    gm, _ = amp(lambda x: torch.exp(x).sum(), X.double(), lists=passes.DEFAULT_LISTS)
    assert casts(gm) == []


def test_low_precision_hint_does_not_lower_a_deny_op():
    import graphamp

    gm, _ = amp(lambda x: torch.exp(graphamp.low_precision(x)), X, lists=passes.DEFAULT_LISTS)
    assert passes.dtype_after_amp(_node(gm, "aten.exp")) == torch.float32


def test_allow_op_casts_the_other_low_precision_to_the_amp_dtype():
    # under bf16 AMP an fp16 input of a matmul is cast to bf16, as autocast does
    gm, _ = amp(
        lambda x, w: torch.mm(x, w), X16, W, dtype=torch.bfloat16, lists=passes.DEFAULT_LISTS
    )
    mm = _node(gm, "aten.mm")
    assert {passes.dtype_after_amp(a) for a in mm.args} == {torch.bfloat16}
    assert passes.verify_dtypes(gm) == []


def test_promote_op_runs_in_the_widest_arriving_dtype():
    def fn(x, w):
        return torch.dot(torch.mm(x, w)[0], torch.mm(w, x)[0]), torch.dot(x[0], w[1])

    gm, _ = amp(fn, X, W, lists=passes.DEFAULT_LISTS)
    low_dot, fp32_dot = [n for n in gm.graph.nodes if op_name(n) == "aten.dot"]
    assert low_dot.meta["amp_colour"] == "promote"
    assert passes.dtype_after_amp(low_dot) == torch.float16  # both inputs arrive fp16
    assert passes.dtype_after_amp(fp32_dot) == torch.float32
    assert passes.verify_dtypes(gm) == []


def test_mixed_promote_inputs_are_cast_to_the_widest_at_capture():
    from graphamp.capture import BuildRoot, capture_forward
    from graphamp.records.inputs import flatten_inputs

    cap = capture_forward(
        BuildRoot({}, lambda a, b: torch.dot(a, b)), flatten_inputs((X16[0], X[1]), {}), "dot"
    )
    dot = _node(cap.gm, "aten.dot")
    assert {a.meta["val"].dtype for a in dot.args} == {torch.float32}


def test_equal_dtype_op_gets_mixed_inputs_cast_to_the_widest():
    def fn(x, v):
        return torch.index_put(x, (torch.tensor([1]),), v)

    gm, _ = amp(fn, X16[0], torch.randn(1), lists=passes.DEFAULT_LISTS)
    put = _node(gm, "aten.index_put")
    assert (
        passes.dtype_after_amp(put.args[0]) == passes.dtype_after_amp(put.args[2]) == torch.float32
    )
    assert passes.verify_dtypes(gm) == []


def _captured(fn, *args, modules=None):
    from graphamp.capture import BuildRoot, capture_forward
    from graphamp.records.inputs import flatten_inputs

    return capture_forward(BuildRoot(modules or {}, fn), flatten_inputs(args, {}), "g").gm


def test_pieces_of_a_composite_op_take_the_whole_ops_list():
    # l1_loss is split into sub and abs (infer); autocast runs the whole loss in fp32
    gm = _captured(lambda a, b: torch.nn.functional.l1_loss(a, b), X16, X16)
    passes.colour_by_lists(gm, AmpContext(lists=passes.DEFAULT_LISTS))
    pieces = [n for n in gm.graph.nodes if n.meta.get("part_of") is aten.l1_loss]
    assert {op_name(n) for n in pieces} >= {"aten.sub", "aten.abs"}
    assert all(n.meta["amp_list"] == "deny" and n.meta["amp_widen"] for n in pieces)
    assert "part of aten.l1_loss" in pieces[0].meta["amp_reason"]


def test_rnn_cell_pieces_run_low_and_follow_user_overrides():
    w_ih, w_hh = torch.randn(16, 4), torch.randn(16, 4)
    fn = lambda x, h, c, a, b: torch.lstm_cell(x, (h, c), a, b)  # noqa: E731
    gm = _captured(fn, X, X, X, w_ih, w_hh)
    ctx = AmpContext(lists=passes.DEFAULT_LISTS)
    gm = run_amp_passes(gm, ctx)
    addmms = [n for n in gm.graph.nodes if op_name(n) == "aten.addmm" or op_name(n) == "aten.mm"]
    assert addmms and all(passes.dtype_after_amp(n) == torch.float16 for n in addmms)
    # (the cell's gates are in-place ops in torch's CPU decomposition)
    sigmoid = next(n for n in gm.graph.nodes if op_name(n).startswith("aten.sigmoid"))
    assert sigmoid.meta["amp_colour"] == "allow" and "aten.lstm_cell" in sigmoid.meta["amp_reason"]
    assert passes.verify_dtypes(gm) == []
    overrides = type(
        "O", (), {"allow": (), "deny": (aten.lstm_cell,), "infer": (), "clear": (), "remove": ()}
    )()
    gm = run_amp_passes(
        _captured(fn, X, X, X, w_ih, w_hh),
        AmpContext(lists=passes.DEFAULT_LISTS.with_overrides(overrides)),
    )
    assert all(
        n.meta["amp_colour"] == "deny"
        for n in gm.graph.nodes
        if op_name(n).startswith("aten.sigmoid")
    )


def test_recurrent_layers_are_kept_whole_and_their_states_follow():
    lstm = torch.nn.LSTM(4, 4, num_layers=2)
    gm = _captured(lambda x: lstm(x), X.view(2, 2, 4), modules={"lstm": lstm})
    rnn = [n for n in gm.graph.nodes if op_name(n) == "graphamp.rnn"]
    assert len(rnn) == 1 and not any(op_name(n) == "aten.mkldnn_rnn_layer" for n in gm.graph.nodes)
    gm = run_amp_passes(gm, AmpContext(lists=passes.DEFAULT_LISTS))
    assert passes.dtype_after_amp(rnn[0]) == (torch.float16,) * 3
    assert passes.verify_dtypes(gm) == []


def test_verify_dtypes_checks_getitem_outputs():
    # on CUDA an LSTM cell is one _thnn_fused_lstm_cell whose cell state (output 1) is data
    from graphamp.capture import BuildRoot, capture_forward
    from graphamp.records.inputs import flatten_inputs

    w_ih, w_hh = torch.randn(16, 4), torch.randn(16, 4)
    bias = torch.randn(16)  # (torch's fake kernel of the fused cell needs the biases)
    root = BuildRoot({}, lambda x, h, c, a, b, d: torch.lstm_cell(x, (h, c), a, b, d, d))
    cap = capture_forward(
        root, flatten_inputs((X, X, X, w_ih, w_hh, bias), {}), "cell", device=torch.device("cuda")
    )
    gm = run_amp_passes(cap.gm, AmpContext(lists=passes.DEFAULT_LISTS))
    fused = _node(gm, "aten._thnn_fused_lstm_cell")
    assert passes.dtype_after_amp(fused)[:2] == (torch.float16, torch.float16)
    assert passes.verify_dtypes(gm) == []
    state = next(u for u in fused.users if u.args[1] == 1)
    state.meta["amp_dtype"] = (
        torch.float32
    )  # a dtype the op does not give: verify_dtypes reports it
    assert any(state.name in m for m in passes.verify_dtypes(gm))


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_a_trace_pauses_the_cycle_collector_and_leaves_it_as_it_found_it(enabled, fails):
    """Traces run with the cycle collector paused (its full collections grow with the model);
    afterwards it is on or off as before, also when the traced function raises."""
    import gc

    from graphamp.torchkit.fxutil import trace_functional

    seen = []

    def fn(x):
        seen.append(gc.isenabled())
        if fails:
            raise ValueError("the user's code failed")
        return x * 2

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        if fails:
            with pytest.raises(ValueError, match="user's code"):
                trace_functional(fn, [torch.ones(3)], propagate_input_mutations=False)
        else:
            gm = trace_functional(fn, [torch.ones(3)], propagate_input_mutations=False)
            assert torch.equal(gm(torch.ones(3)), torch.full((3,), 2.0))
        assert seen == [False]
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
