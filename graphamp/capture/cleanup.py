"""After tracing: check what build() changed, make the captured forward pure, describe it.

build() may change buffers in place (BatchNorm statistics) and parameters (under no_grad, as SAM
does; a value it makes that way is a gradient leaf of the parameter), never its arguments;
values computed under ``torch.no_grad()`` must carry no gradient; only buffers build() really
changed stay among the outputs; parameters no loss depends on are left out of the update.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._functionalize_has_data_mutation, torch._functionalize_has_metadata_mutation,
#   torch._subclasses, torch._sync
import torch
import torch.fx as fx
from torch._subclasses.functional_tensor import FunctionalTensor

from ..errors import CaptureError
from ..records.layouts import ForwardLayout
from ..records.spec import CapturedForward

aten = torch.ops.aten


def mutated_inputs(flat: tuple) -> list[int]:
    """Positions of the traced function's inputs it changed in place (data or metadata), read
    from the functional wrappers while functionalization is active."""
    out = []
    for i, t in enumerate(flat):
        if isinstance(t, FunctionalTensor):
            torch._sync(t)
            if torch._functionalize_has_data_mutation(  # type: ignore[attr-defined]  # not in torch's stubs
                t.elem
            ) or torch._functionalize_has_metadata_mutation(t.elem):
                out.append(i)
    return out


def check_input_mutations(
    mutated: list[int],
    layout: ForwardLayout,
    input_names: list[str],
    graph_name: str,
) -> list[int]:
    """In-place changes to g(...)'s arguments are errors; returns the mutated buffers' indexes
    (their new values are among the forward's outputs). Parameters build() changes (SAM's
    perturbation) are the step's ``GradientCode.changed_params``. ``mutated``: positions among
    the traced function's flat inputs (``layout``)."""
    groups = layout.split(range(len(layout)))
    for i in mutated:
        if i in groups.inputs:
            raise CaptureError(
                f"{graph_name}.build() changes its argument {input_names[groups.inputs.index(i)]!r}"
                " in place; work on a copy (x = x.clone()) or return the new value instead"
            )
    return [groups.buffers.index(i) for i in mutated if i in groups.buffers]


def lift_constants(
    gm: fx.GraphModule, owners: dict[int, str]
) -> tuple[list[torch.Tensor], list[str]]:
    """Turn the tensors build() read from outside (module attributes that are neither
    parameters nor buffers, globals, helper objects' tables) into inputs after the last
    placeholder. Each call then passes the live object, so in-place changes are seen.
    Returns the tensors and their names (``owners``: id -> attribute path where known)."""
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    lifted: dict[int, fx.Node] = {}  # id(tensor) -> its placeholder
    attrs = set()
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:
        value = getattr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        placeholder = lifted.get(id(value))
        if placeholder is None:
            name = owners.get(id(value), f"constant{len(tensors)}")
            with gm.graph.inserting_after(last):
                # a placeholder's target is its argument name in the generated code: an
                # identifier ("c_model_cos_cached" for the attribute model.cos_cached)
                placeholder = gm.graph.placeholder(_identifier(f"c_{name}"))
            placeholder.meta.update(node.meta)
            lifted[id(value)] = last = placeholder
            tensors.append(value)
            names.append(name)
        node.replace_all_uses_with(placeholder)
        gm.graph.erase_node(node)
        attrs.add(node.target)
    for attr in attrs:
        delattr(gm, attr)
    return tensors, names


def _identifier(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


def drop_autograd_detaches(gm: fx.GraphModule) -> None:
    """Remove the detaches autograd itself made (a saved output unpacked while build()'s own
    torch.autograd.grad ran): the step differentiates this graph again, and a gradient penalty's
    second derivative flows through them. The user's ``.detach()`` / ``.data`` stay."""
    for node in list(gm.graph.nodes):
        if node.target is aten.detach.default and not node.meta.get("user_detach"):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def detach_no_grad_values(gm: fx.GraphModule) -> None:
    """Values computed under torch.no_grad() in build() carry no gradient, as in eager mode."""
    for node in list(gm.graph.nodes):
        if not node.meta.get("no_grad") or "param_version" in node.meta:
            continue  # a parameter's new value is a gradient leaf of that parameter
        users = [u for u in node.users if not u.meta.get("no_grad")]
        val = node.meta.get("val")
        if not users or not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            continue
        with gm.graph.inserting_after(node):
            detached = gm.graph.call_function(aten.detach.default, (node,))
        detached.meta.update(
            val=val,
            nn_module_stack=node.meta.get("nn_module_stack"),
            user_frame=node.meta.get("user_frame"),
            no_grad=False,
            user_detach=True,
        )
        for user in users:
            user.replace_input_with(node, detached)


def keep_changed_buffers(
    gm: fx.GraphModule,
    buffers: list[fx.Node],
    first_buffer_output: int,
    mutated: list[int],
    trailing: int = 0,
) -> list[int]:
    """Drop the outputs of buffers build() left unchanged (``buffers``: the buffers'
    placeholders; ``trailing`` outputs follow theirs); returns the changed buffers' indexes, in
    output order."""
    output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = list(output_node.args[0])
    tail = outs[len(outs) - trailing :] if trailing else []
    buffer_outs = outs[first_buffer_output : len(outs) - trailing]
    changed = [i for i, node in enumerate(buffer_outs) if node is not buffers[i]]
    unexpected = set(mutated) - set(changed)
    if unexpected:  # a copy_ into a buffer that functional_call did not see: keep its value
        raise CaptureError(f"internal: buffer update not visible for {sorted(unexpected)}")
    kept = [buffer_outs[i] for i in changed]
    output_node.args = (tuple(outs[:first_buffer_output] + kept + tail),)
    return changed


def params_without_path_to_losses(captured: CapturedForward) -> set[int]:
    """Parameters no loss sends gradients to: eager autograd leaves their .grad None and the
    optimizer skips them (no weight decay, no momentum); the step must do the same."""
    graph = captured.gm.graph
    output_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    _, losses, _, _ = captured.split_outputs(output_node.args[0])
    params = captured.layout.split([n for n in graph.nodes if n.op == "placeholder"]).params
    code = captured.gradient_code
    used: set[int] = set(code.grad_params)  # the .grad build() left
    taken = code.losses_taken  # build() took these losses' gradients itself
    for loss, restrict in list(zip(losses, captured.loss_inputs))[taken:]:
        reached: set[fx.Node] = set()
        stack = [loss] if isinstance(loss, fx.Node) else []
        while stack:
            node = stack.pop()
            if node in reached or node.target is aten.detach.default:
                continue
            reached.add(node)
            stack.extend(node.all_input_nodes)
        reachable = {i for i, p in enumerate(params) if p in reached}
        used |= reachable if restrict is None else reachable & restrict
    return set(range(len(params))) - used
