"""Custom ``torch.autograd.Function`` calls seen at capture, each kept whole in the captured
forward as one ``graphamp::autograd_function`` node (registered in ``ops.py``): the node's
integer key finds its call here, and step assembly calls ``MyFunction.apply`` again under
autograd, so the user's own backward differentiates it."""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.utils._pytree
import itertools
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor


class FunctionCall:
    """One ``MyFunction.apply(...)`` call seen at capture: the class and its non-tensor arguments.

    The captured forward holds it as one ``graphamp.autograd_function`` node (the AMP passes see
    one op, kept fp32 unless the user lists the class); step assembly calls ``MyFunction.apply``
    again under autograd, so the user's own backward is what differentiates it.
    """

    def __init__(self, cls: type, args: tuple, kwargs: dict):
        self.cls = cls
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        self.template = [None if isinstance(x, Tensor) else x for x in leaves]
        self.key = next(_KEYS)
        self.out_spec: Any = None  # set when the forward first runs
        self.out_template: list[Any] = []
        _CALLS[self.key] = self

    def tensor_args(self, args: tuple, kwargs: dict) -> list[Tensor]:
        return [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor)]

    def apply(self, tensors: list[Tensor]) -> list[Tensor]:
        """``cls.apply`` on these tensor arguments; its tensor outputs, flattened."""
        it = iter(tensors)
        args, kwargs = pytree.tree_unflatten(
            [next(it) if x is None else x for x in self.template], self.spec
        )
        out = _ORIGINAL_APPLY.__get__(None, self.cls)(*args, **kwargs)
        leaves, self.out_spec = pytree.tree_flatten(out)
        self.out_template = [None if isinstance(x, Tensor) else x for x in leaves]
        return [x for x in leaves if isinstance(x, Tensor)]

    def rebuild_outputs(self, tensors: list[Tensor]) -> Any:
        it = iter(tensors)
        return pytree.tree_unflatten(
            [next(it) if x is None else x for x in self.out_template], self.out_spec
        )


_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
_KEYS = itertools.count()
# Captured forwards keep their calls alive (CapturedForward.function_calls); the op finds them here.
_CALLS: weakref.WeakValueDictionary[int, FunctionCall] = weakref.WeakValueDictionary()


def function_call(key: int) -> FunctionCall:
    """The call a ``graphamp::autograd_function`` node's ``key`` names (alive while the captured
    forward that holds it is)."""
    return _CALLS[key]
