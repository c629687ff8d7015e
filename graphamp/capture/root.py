"""The module tree build() runs on, and the facts capture checks on it before tracing."""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._subclasses
import contextlib
import difflib
import logging
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import CaptureError, ConfigError, InputError
from ..records.inputs import FlatInputs
from ..records.model_pins import model_fp32_pins

log = logging.getLogger("graphamp")


class BuildRoot(nn.Module):
    """Holds a Graph's registered modules so functional_call can swap in traced tensors.

    ``owner``: the object whose attributes build() reads as ``self.<name>`` (the Graph; None for
    a plain function), watched by capture like the modules; ``own``: its attributes that are
    graphamp's, not settings of the user's."""

    def __init__(
        self,
        modules: Mapping[str, nn.Module] | Iterable[tuple[str, nn.Module]],
        build: Callable[..., Any],
        owner: Any = None,
        own: frozenset[str] = frozenset(),
    ):
        super().__init__()
        for name, module in modules.items() if isinstance(modules, Mapping) else modules:
            self.add_module(name, module)
        self._build = build
        self.owner = owner if hasattr(owner, "__dict__") else None
        self.own = own

    def forward(self, args: tuple, kwargs: dict, buffer_names: list[str]):
        out = self._build(*args, **kwargs)
        # Read the buffers while the traced values are swapped in: these are the updated ones.
        return out, [self.get_buffer(n) for n in buffer_names]


def check_devices(graph_name: str, root: BuildRoot, inputs: FlatInputs) -> torch.device:
    """The one device the registered modules and the batch share; InputError otherwise."""
    devices = {t.device for t in root.parameters()} | {t.device for t in root.buffers()}
    if len(devices) > 1:
        raise InputError(
            f"{graph_name}: the registered modules have tensors on {sorted(map(str, devices))}; "
            "a Graph runs on one device: move them all (model.to(device))"
        )
    device = next(iter(devices)) if devices else None
    for i, t in enumerate(inputs.tensors):
        if device is None:
            device = t.device
        if t.device != device:
            raise InputError(
                f"{graph_name}(...): input tensor {i} is on {t.device} but the graph runs on "
                f"{device}; move the batch there (x.to({str(device)!r}))"
            )
    return device or torch.device("cpu")


def refuse_sparse_tensors(graph_name: str, root: BuildRoot, inputs: FlatInputs) -> None:
    """A sparse (or other non-strided) input, parameter or buffer: graphamp traces its step on
    dense fake tensors, which torch cannot make of a sparse one (its errors say nothing of
    where). Refused by name, with the way that traces: a sparse tensor made inside build()."""
    for i, t in enumerate(inputs.tensors):
        if t.layout != torch.strided:
            name = inputs.names(root._build)[i]
            raise InputError(
                f"{graph_name}(...): the input {name} is a {t.layout} tensor; graphamp traces "
                f"the step on dense tensors. Pass its parts ({name}.indices(), "
                f"{name}.values(); for CSR {name}.crow_indices(), {name}.col_indices(), "
                f"{name}.values()) and make it inside build() with torch.sparse_coo_tensor "
                f"(torch.sparse_csr_tensor), where it traces; or pass {name}.to_dense()"
            )
    for kind, named in (("parameter", root.named_parameters()), ("buffer", root.named_buffers())):
        for name, t in named:
            if t.layout != torch.strided:
                raise CaptureError(
                    f"{graph_name}: the {kind} {name} is a {t.layout} tensor; graphamp's step "
                    "keeps its state dense (its gradients and optimizer updates are dense): "
                    "make it dense (nn.Parameter(p.to_dense())), or train it eagerly"
                )


def refuse_compiled_submodules(graph_name: str, root: BuildRoot) -> None:
    """A torch.compile'd module inside a registered one would run Dynamo inside graphamp's
    trace (registered at the top, the Graph unwraps it itself): refused by name."""
    for path, module in root.named_modules():
        if path and isinstance(getattr(module, "_orig_mod", None), nn.Module):
            raise CaptureError(
                f"{graph_name}: {path!r} is a torch.compile'd module inside a registered module. "
                "graphamp compiles the whole step itself: put the original module there "
                f"({path} = {path}._orig_mod), or register the compiled module on the Graph "
                "directly, where graphamp uses its original"
            )


def pinned_paths(
    root: BuildRoot, types: tuple[type, ...], names: tuple[str, ...], dtype: torch.dtype
) -> dict[str, str]:
    """Module path -> why its ops stay fp32: every module of the types and every module at or
    below the names given to config.pin_fp32 (a name that matches no module is an error), and
    the parts the model itself declares fp32 (model_pins.py). The user's reason wins."""
    modules = _named_modules_checked(root, names, "pin_fp32")
    _warn_unmatched_types(modules, types, "pin_fp32")
    paths = model_fp32_pins(root, dtype)
    for path, module in modules.items():
        if not path:
            continue
        by_type = next((t for t in types if isinstance(module, t)), None)
        by_name = next((w for w in names if path == w or path.startswith(w + ".")), None)
        if by_type is not None or by_name is not None:
            what = by_type.__name__ if by_type is not None else repr(by_name)
            paths[path] = f"pinned fp32 by config.pin_fp32({what})"
    return paths


def checkpointed_paths(
    root: BuildRoot, types: tuple[type, ...], names: tuple[str, ...]
) -> frozenset[str]:
    """The recompute regions of config.enable_activation_checkpointing: every module of the
    given types and every named module, outermost only (a marked module inside a marked
    module belongs to its parent's region). A name that matches no module is an error."""
    if not types and not names:
        return frozenset()
    modules = _named_modules_checked(root, names, "enable_activation_checkpointing")
    _warn_unmatched_types(modules, types, "enable_activation_checkpointing")
    marked = [p for p, m in modules.items() if p and (isinstance(m, types) or p in names)]
    return frozenset(p for p in marked if not any(p.startswith(q + ".") for q in marked if q != p))


def check_module_paths(root: BuildRoot, names: tuple[str, ...], setter: str) -> None:
    """Each path a setting named (``setter``) is a registered module: an error naming the
    nearest path where one is not, rather than a module left out without a word."""
    _named_modules_checked(root, names, setter)


def _named_modules_checked(
    root: BuildRoot, names: tuple[str, ...], setter: str
) -> dict[str, nn.Module]:
    modules = dict(root.named_modules())
    for wanted in names:
        if wanted not in modules:
            close = _nearest_paths(wanted, [n for n in modules if n])
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{setter}({wanted!r}): no registered module has that path{hint} (paths "
                "start at the Graph's attributes, e.g. 'model.head')"
            )
    return modules


def _warn_unmatched_types(
    modules: dict[str, nn.Module], types: tuple[type, ...], setter: str
) -> None:
    """A module type that no registered module has: a warning, not an error (one config may
    serve several models), but never silence."""
    for t in types:
        if not any(isinstance(m, t) for m in modules.values()):
            log.warning(
                "%s(%s): no registered module is a %s, so it changes nothing here",
                setter,
                t.__name__,
                t.__name__,
            )


def _nearest_paths(wanted: str, paths: list[str]) -> list[str]:
    """Paths that end with ``wanted`` (a path written from the model instead of the Graph),
    then those that share its last name, then the closest spellings."""
    relative = [p for p in paths if p.endswith("." + wanted)]
    same_name = [p for p in paths if p.split(".")[-1] == wanted.split(".")[-1]]
    return relative or same_name or difflib.get_close_matches(wanted, paths, n=1, cutoff=0.6)


@contextlib.contextmanager
def quiet_fake_data_pointers() -> Iterator[None]:
    """nn.LSTM/GRU compare their weights' data pointers to decide whether to flatten them; on
    fake tensors torch warns about it. Nothing reads real memory during capture: silence it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        yield


def fake_copy(mode: FakeTensorMode, t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A fake tensor like ``t`` (on ``device`` if given), keeping requires_grad and leafness."""
    with mode:
        out = torch.empty_strided(
            t.shape, t.stride(), dtype=t.dtype, device=device if device is not None else t.device
        )
    return out.requires_grad_(t.requires_grad) if t.dtype.is_floating_point else out
