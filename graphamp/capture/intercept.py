"""What changes while build() is traced.

- ``loss.backward(...)`` is recorded, not run: the loss becomes an output of the forward graph and
  step assembly differentiates it later.
- BatchNorm is routed to ``aten._native_batch_norm_legit_functional`` and its running statistics
  are updated with ``copy_`` at the Python level, where functionalization turns the update into
  a value the step can mask on overflow (``aten.native_batch_norm`` would mutate the statistics
  below functionalization, invisibly).
- Dropout is routed to ``aten.native_dropout`` on every device, so the mask is one op that follows
  its input's precision (on CPU ``F.dropout`` would decompose into an fp32 bernoulli chain).
- Every node the trace appends is tagged with the module stack and the user's source line.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._pack_padded_sequence, torch._subclasses, torch.utils._pytree
import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.overrides import TorchFunctionMode

from ..errors import CaptureError
from ..torchkit.capture_rewrites import CAPTURE_REWRITES
from ..torchkit.fxutil import (
    UserFrame,
    current_user_frame,
    last_node,
    nodes_after,
    tracing_graph,
)
from ..torchkit.process_state import module_forward_hooks
from .dtype_checks import mixed_dtypes
from .gradient_book import GradientBook
from .host_reads import (
    HOST_READS,
    SAFE_ANSWERS,
    grad_access_error,
    grad_access_from_optimizer_step,
    host_read_error,
    torch_function_reading,
    where_in_user_code,
)
from .op_errors import VALUE_DEPENDENT, mark_torch_function
from .op_forms import (
    functional_batch_norm,
    gaussian_nll_loss,
    native_dropout,
    scaled_grad,
    sdpa_with_autocast_policy,
)
from .scaler_refusal import called_from_torch_grad_scaler, torch_grad_scaler_error
from .scope_reads import untraced

aten = torch.ops.aten


@dataclass
class RecordedLoss:
    tensor: torch.Tensor
    gradient: torch.Tensor | None
    where: UserFrame | None
    retained: bool = False  # backward(retain_graph=True): a second backward() on it is allowed
    inputs: tuple = ()  # backward(inputs=...): the only tensors this loss sends gradients to


class CaptureMode(TorchFunctionMode):
    """Active while build() is traced; see the module docstring."""

    def __init__(
        self,
        module_names: dict[int, str],
        sdpa_policy: torch.dtype | None = None,
        loss_scale: torch.Tensor | None = None,
        mixed_dtypes_ok: bool = False,
        params: tuple[torch.Tensor, ...] = (),
        aliases: dict[int, torch.Tensor] | None = None,
        grad_group: Any = None,
    ):
        super().__init__()
        self.module_names = module_names
        # with graphamp's AMP on, its casts reconcile fp16/bf16/fp32 inputs (promote, widening)
        self.mixed_dtypes_ok = mixed_dtypes_ok
        self._modules_by_id: dict[int, tuple[nn.Module, str]] = {}  # filled as modules run
        # The step's loss scale (a traced 0-dim input): gradients build() takes itself are
        # computed scaled and unscaled before use, torch's recipe for gradient penalties.
        self.loss_scale = loss_scale
        # Set by the autocast oracle: attention follows autocast's lower_precision_fp policy.
        self.sdpa_policy = sdpa_policy
        self.losses: list[RecordedLoss] = []
        # the .grad of the traced tensors (gradient_book.py): build() may read and write them
        self.book = GradientBook(params, loss_scale, grad_group) if loss_scale is not None else None
        self._param_ids = {id(p): i for i, p in enumerate(params)}
        # id(the user's parameter or buffer) -> its traced value: code that reaches the state
        # through another path than the module (an optimizer's param_groups, as zero_grad()
        # and SAM's optimizer do) reads and writes the traced values, as the module's code does
        self.aliases = aliases or {}
        self._backward_seen: dict[int, RecordedLoss] = {}
        self._stack: list[tuple[str, str]] = []
        self._stack_meta: dict[str, tuple[str, str]] = {}

    # -- module stack, from global module hooks ---------------------------------------------------
    @contextlib.contextmanager
    def tracking_modules(self) -> Iterator[None]:
        with module_forward_hooks(self._enter_module, self._exit_module):  # process_state's
            yield

    def _enter_module(self, module: nn.Module, _args: Any) -> None:
        path = self.module_names.get(id(module))
        self._modules_by_id[id(module)] = (module, path or "")
        if path is None:  # a module built inside build() or not registered: name it by type
            _refuse_unregistered_state(module)
            path = f"<{type(module).__name__}>"
        if path == "":
            return
        self._stack.append((path, f"{type(module).__module__}.{type(module).__qualname__}"))
        self._stack_meta = {p: (p, t) for p, t in self._stack}

    def _exit_module(self, module: nn.Module, _args: Any, _output: Any) -> None:
        path = self.module_names.get(id(module), f"<{type(module).__name__}>")
        if path == "" or not self._stack:
            return
        if self._stack[-1][0] == path:
            self._stack.pop()
            self._stack_meta = {p: (p, t) for p, t in self._stack}

    def _owner_of(self, target: Any) -> str | None:
        """The module attribute path that holds ``target`` (a plain tensor attribute), if any."""
        return next(
            (
                f"{path}.{k}" if path else k
                for m, path in self._modules_by_id.values()
                for k, v in vars(m).items()
                if v is target
            ),
            None,
        )

    def _changed_by_op_error(self, func, args, kwargs) -> CaptureError:
        """An op given a real tensor (a plain attribute: a constant of the step) changes it in
        place (``F.batch_norm``'s running statistics) or a tensor it computes from it
        (``F.cosine_similarity``): functionalization refuses to trace either."""
        real = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        real = [t for t in real if _is_real(t)]
        owners = [o for o in map(self._owner_of, real) if o]
        what = (
            f"the tensor {owners[0]!r} (a plain attribute, not a buffer)"
            if owners
            else "a tensor that is neither a parameter, a buffer nor an argument"
        )
        return CaptureError(
            f"build() passes {what} to {getattr(func, '__name__', func)}"
            f"{where_in_user_code(current_user_frame())}, which changes it, or a tensor it "
            "computes from it, in place. It is a constant of the compiled step, which the step "
            "cannot trace such changes of: register it as a buffer (module.register_buffer("
            "name, tensor), persistent=False if it is not state to save), which the step "
            "traces and updates where the op does (BatchNorm's running statistics)"
        )

    def _real_tensor_write_error(self, func, args, kwargs) -> CaptureError:
        target = kwargs.get("out", args[0] if args else None)
        owner = self._owner_of(target)
        what = (
            f"the tensor {owner!r} (a plain attribute, not a buffer)"
            if owner
            else "a tensor that is neither a parameter, a buffer nor an argument"
        )
        return CaptureError(
            f"build() changes {what} in place with {getattr(func, '__name__', func)}"
            f"{where_in_user_code(current_user_frame())}. It is read as a constant of the compiled step, so "
            "the change would happen once, at capture. Make it a buffer "
            "(module.register_buffer(name, tensor)) to have the step update it, or change it "
            "outside build()"
        )

    # -- torch functions --------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.aliases:
            args, kwargs = pytree.tree_map_only(torch.Tensor, self._traced, (args, kwargs))
        self._refuse(func, args, kwargs)
        if func in HOST_READS:
            culprit = torch_function_reading()
            if culprit is not None and culprit[1] in SAFE_ANSWERS:
                return SAFE_ANSWERS[culprit[1]]
            raise host_read_error(func, culprit)
        if func in _GRAD_ACCESS:
            return self._grad_access(func, args)
        if func == _DATA.__set__:
            return self._set_data(*args)
        if func is torch.Tensor.backward:
            return self._record_backward(*args, **kwargs)
        if func is torch.autograd.backward:
            return self._record_autograd_backward(*args, **kwargs)
        graph = tracing_graph()
        marker = last_node(graph) if graph is not None else None
        out = self._run(func, args, kwargs)
        if graph is not None and marker is not None:
            self._tag(graph, marker, func in _GRADIENT_CUTS)
            self._mark_parameter_version(func, args, graph, marker)
        return out

    def _run(self, func, args: tuple, kwargs: dict) -> Any:
        """``func`` traced, its failures that name something of the user's worded so."""
        try:
            with untraced():  # torch's work: no user code to watch (scope_reads.py)
                return self._call(func, args, kwargs)
        except VALUE_DEPENDENT as e:  # an op that needs values: name the function called
            mark_torch_function(e, func)
            raise
        except RuntimeError as e:  # an op changed a real tensor it was given, in place
            if "mutating a non-functional tensor" in str(e):
                raise self._changed_by_op_error(func, args, kwargs) from e
            raise

    def _set_data(self, target: torch.Tensor, value: torch.Tensor) -> None:
        """``target.data = value`` (SAM's restore): the traced tensor takes ``value``'s
        values, as ``copy_`` under no_grad; what would change its shape or dtype is refused."""
        where = where_in_user_code(current_user_frame())
        if _is_real(target):
            raise self._real_tensor_write_error(_DATA.__set__, (target,), {})
        if value.shape != target.shape or value.dtype != target.dtype:
            raise CaptureError(
                f"build() sets .data{where} to a tensor of shape {tuple(value.shape)} and "
                f"dtype {value.dtype}, where the tensor has {tuple(target.shape)} and "
                f"{target.dtype}: graphamp keeps every parameter's shape and dtype; copy the "
                "values in (with torch.no_grad(): p.copy_(value))"
            )
        with torch.no_grad():
            self.__torch_function__(torch.Tensor.copy_, (), (target, value))

    def _traced(self, t: torch.Tensor) -> torch.Tensor:
        return self.aliases.get(id(t), t)

    def _grad_access(self, func, args: tuple) -> Any:
        """``tensor.grad`` read or written by build(): the gradient book's (module docstring)."""
        if grad_access_from_optimizer_step():
            raise grad_access_error(_GRAD_ACCESS[func])
        if self.book is None:  # a trace with no loss scale: nothing differentiates here
            raise CaptureError(
                f"build() reads a .grad{where_in_user_code(current_user_frame())} where none exists"
            )
        graph = tracing_graph()
        marker = last_node(graph) if graph is not None else None
        with untraced():
            if _GRAD_ACCESS[func] == "reads":
                out = self.book.get(args[0], self.losses)
            else:
                self.book.set(args[0], args[1], self.losses)
                out = None
        if graph is not None and marker is not None:
            self._tag(graph, marker, user_cut=True)  # the gradients carry no gradient
        return out

    def _mark_parameter_version(self, func, args: tuple, graph: fx.Graph, marker: fx.Node) -> None:
        """An in-place op on a parameter (SAM's ``p.add_(e)`` under no_grad) makes the
        parameter's next value: as in eager, a later forward's gradient goes to the parameter
        itself, so the step differentiates with respect to that value as a leaf."""
        if not args or not isinstance(args[0], torch.Tensor) or not _in_place(func):
            return
        position = self._param_ids.get(id(args[0]))
        if position is None:
            return
        new = [n for n in nodes_after(graph, marker) if n.op == "call_function"]
        if new:
            new[-1].meta["param_version"] = position

    def _refuse(self, func, args: tuple, kwargs: dict) -> None:
        """Raise for what build() must not do inside a captured step."""
        if called_from_torch_grad_scaler():  # scale(), unscale_(), ... of torch's own scaler
            raise torch_grad_scaler_error(current_user_frame())
        if _writes_real_tensor(func, args, kwargs):
            raise self._real_tensor_write_error(func, args, kwargs)
        mixed = mixed_dtypes(func, args, kwargs, amp=self.mixed_dtypes_ok)
        if mixed is not None:
            raise CaptureError(
                f"build() calls {getattr(func, '__name__', func)} on tensors of different dtypes "
                f"({' and '.join(mixed)}){where_in_user_code(current_user_frame())}; eager PyTorch refuses "
                "this too. Cast them to one dtype (e.g. x.to(layer.weight.dtype)); leave mixed "
                "precision to graphamp's AMP"
            )
        if func is torch._pack_padded_sequence:
            raise CaptureError(
                f"build() packs a padded sequence (pack_padded_sequence)"
                f"{where_in_user_code(current_user_frame())}: a PackedSequence's batch sizes are "
                "host data, computed from the lengths' values, and they shape every step of the "
                "RNN, which a compiled step cannot follow from batch to batch. Fix: run the RNN on "
                "the padded batch and mask the padded positions (the loss's ignore_index, or "
                "multiply by a mask), as graphamp's step then serves every length"
            )
        if func is torch.Tensor.register_hook:
            raise CaptureError(
                f"build() registers a gradient hook (Tensor.register_hook)"
                f"{where_in_user_code(current_user_frame())}. The gradients are computed inside the "
                "compiled step from the captured graph, where the hook would never run. Fix: "
                "change the gradient in a custom torch.autograd.Function's backward (graphamp "
                "captures it with its backward), or register the hook outside build() on an "
                "eager run"
            )

    def _call(self, func, args: tuple, kwargs: dict) -> Any:
        """``func`` itself, or the form capture records it in (module docstring)."""
        if func is torch.autograd.grad and self.loss_scale is not None:
            return scaled_grad(self.loss_scale, *args, **kwargs)
        if func is F.batch_norm:
            return functional_batch_norm(*args, **kwargs)
        if func is F.dropout:
            return native_dropout(*args, **kwargs)
        if func is F.gaussian_nll_loss:
            return gaussian_nll_loss(*args, **kwargs)
        if func is F.scaled_dot_product_attention and self.sdpa_policy is not None:
            return sdpa_with_autocast_policy(self.sdpa_policy, *args, **kwargs)
        if func in CAPTURE_REWRITES:
            return CAPTURE_REWRITES[func](*args, **kwargs)
        return func(*args, **kwargs)

    def _tag(self, graph: fx.Graph, marker: fx.Node, user_cut: bool) -> None:
        """Module stack, user line and no_grad on the nodes the last call appended; the user's
        own detaches marked as such (``user_cut``)."""
        where = current_user_frame()
        stack = self._stack_meta
        no_grad = not torch.is_grad_enabled()
        for node in nodes_after(graph, marker):
            meta = node.meta
            if "user_frame" not in meta:
                meta["user_frame"] = where
                meta["nn_module_stack"] = stack
                if no_grad:
                    meta["no_grad"] = True
            if user_cut and node.target is aten.detach.default:
                meta["user_detach"] = True

    def _record_backward(
        self,
        tensor: torch.Tensor,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Any = None,
    ) -> None:
        where = current_user_frame()
        if create_graph:
            raise CaptureError(
                f"backward(create_graph=True){where_in_user_code(where)}: higher-order gradients are not "
                "supported inside a graphamp Graph; compute them eagerly instead"
            )
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        inputs = tuple(inputs) if inputs is not None else ()
        if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
            raise CaptureError(f"backward() on a non-floating tensor{where_in_user_code(where)}")
        if gradient is None and tensor.numel() != 1:
            raise CaptureError(
                f"backward() on a tensor of shape {tuple(tensor.shape)}{where_in_user_code(where)}: a gradient "
                "can be implied only for a scalar loss; reduce it (loss.mean()) or pass "
                "backward(gradient=...)"
            )
        if gradient is not None and (
            not isinstance(gradient, torch.Tensor) or gradient.shape != tensor.shape
        ):
            shape = tuple(gradient.shape) if isinstance(gradient, torch.Tensor) else gradient
            raise CaptureError(
                f"backward(gradient=...){where_in_user_code(where)}: the gradient must be a tensor of the "
                f"loss's shape {tuple(tensor.shape)}, got {shape}"
            )
        previous = self._backward_seen.get(id(tensor))
        if previous is not None and previous.tensor is tensor and not previous.retained:
            raise CaptureError(
                f"backward() was called twice on the same tensor{where_in_user_code(where)} (first"
                f"{where_in_user_code(previous.where)}). As in eager PyTorch this needs retain_graph=True on "
                "the first call; to train on several losses, call backward() once on each or on "
                "their sum"
            )
        record = RecordedLoss(tensor, gradient, where, retained=bool(retain_graph), inputs=inputs)
        self._backward_seen[id(tensor)] = record
        self.losses.append(record)
        return None

    def _record_autograd_backward(
        self,
        tensors,
        grad_tensors=None,
        retain_graph=None,
        create_graph=False,
        grad_variables=None,
        inputs=None,
    ):
        if isinstance(tensors, torch.Tensor):
            tensors = (tensors,)
        grads = grad_tensors if grad_tensors is not None else grad_variables
        if grads is None or isinstance(grads, torch.Tensor):
            grads = (grads,) * len(tensors) if grads is None else (grads,)
        for t, g in zip(tensors, grads):
            self._record_backward(t, g, retain_graph, create_graph, inputs)


def _writes_real_tensor(func, args, kwargs) -> bool:
    """An in-place op or an ``out=`` on a real tensor (a constant of the step, not a traced
    value): run at capture, it would change the user's tensor once, with no effect later."""
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor) and _is_real(out):
        return True
    return (
        _in_place(func) and bool(args) and isinstance(args[0], torch.Tensor) and _is_real(args[0])
    )


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS


_IN_PLACE_DUNDERS = frozenset(
    {
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
        "__setitem__",
    }
)


def _is_real(t: torch.Tensor) -> bool:
    return not isinstance(t, (FakeTensor, FunctionalTensor))


def _refuse_unregistered_state(module: nn.Module) -> None:
    """A module with real parameters or buffers that is not registered on the Graph: its
    parameters would be traced as constants (no gradient, no update) and its buffers' updates
    (BatchNorm statistics) would be lost, silently. Registered modules hold traced values here."""
    state = [t for t in (*module.parameters(), *module.buffers()) if _is_real(t)]
    if state:
        raise CaptureError(
            f"build() calls a {type(module).__name__} that is not registered on the Graph"
            f"{where_in_user_code(current_user_frame())}: its parameters would be constants (no gradient, no "
            "update) and its buffer updates would be lost. Register it in __init__ "
            f"(self.<name> = module), or create it inside a registered module"
        )


def parameter_positions(record: RecordedLoss, position: dict[int, int]) -> frozenset[int] | None:
    """The forward-parameter positions backward(inputs=...) named (None: all parameters)."""
    if not record.inputs:
        return None
    out = set()
    for t in record.inputs:
        if id(t) not in position:
            raise CaptureError(
                f"backward(inputs=...){where_in_user_code(record.where)} names a tensor that "
                "is not a parameter of a registered module; graphamp differentiates with respect to "
                "parameters only (pass, e.g., inputs=list(self.generator.parameters()))"
            )
        out.add(position[id(t)])
    return frozenset(out)


# What the user writes to stop gradients. Autograd's own detaches (saved outputs unpacked when
# build() differentiates with torch.autograd.grad) are not cuts: capture removes them.
# (Tensor.data and Tensor.grad are C descriptors; the stubs type them as tensors.)
_DATA: Any = torch.Tensor.data
_GRAD: Any = torch.Tensor.grad
_GRADIENT_CUTS = frozenset({torch.Tensor.detach, torch.detach, _DATA.__get__, torch.Tensor.detach_})
# .grad in build() is the gradient book's, except from torch.optim's step() (host_reads.py)
_GRAD_ACCESS = {_GRAD.__get__: "reads", _GRAD.__set__: "writes"}
