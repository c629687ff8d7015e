"""GraphConfig: verb-named setters in the style of OneFlow's ``nn.Graph.config``.

One config object per Graph, passed explicitly to every stage; no globals, no environment variables.
Every setter validates its input at once, so a bad value fails where it is written, not at the
first call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch

from .errors import ConfigError

BACKENDS = ("inductor", "aot_eager", "eager")
OPT_LEVELS = ("O0", "O1", "O2", "O3")
LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass
class ListOverrides:
    """Ops moved between the precision lists by the user (names are resolved by the AMP passes)."""

    allow: tuple[Any, ...] = ()
    deny: tuple[Any, ...] = ()
    infer: tuple[Any, ...] = ()
    clear: tuple[Any, ...] = ()
    remove: tuple[Any, ...] = ()


class GraphConfig:
    """Settings of one Graph. Read by capture, the AMP passes, step assembly and compile."""

    def __init__(self) -> None:
        self.amp_enabled = False
        self.amp_dtype: torch.dtype = torch.float16
        self.amp_opt_level = "O1"
        self.list_overrides = ListOverrides()
        self.fp32_module_types: tuple[type, ...] = ()
        self.fp32_module_names: tuple[str, ...] = ()
        self.backend = "inductor"
        self.cuda_graph: bool | None = None  # None: on for CUDA when shapes are static
        self.grad_acc_steps = 1
        self.max_cached_graphs = 8
        self.inductor_options: dict = {}
        self.data_parallel = False
        self.process_group = None
        self.debug_level = 0

    # -- AMP -----------------------------------------------------------------------------------
    def enable_amp(self, mode: bool = True, *, dtype: torch.dtype = torch.float16) -> None:
        """Run the step in mixed precision: ``dtype`` is torch.float16 (default) or torch.bfloat16."""
        if not isinstance(mode, bool):
            raise ConfigError(f"enable_amp(mode) takes True or False, got {mode!r}")
        if dtype not in LOW_PRECISION_DTYPES:
            raise ConfigError(
                f"enable_amp(dtype={dtype!r}): the low-precision dtype must be torch.float16 or "
                "torch.bfloat16"
            )
        self.amp_enabled = mode
        self.amp_dtype = dtype

    def set_amp_opt_level(self, level: str) -> None:
        """apex-style opt level: O0 off, O1 lists (default), O2 all but deny/pinned, O3 all."""
        if level not in OPT_LEVELS:
            raise ConfigError(
                f"unknown AMP opt level {level!r}; choose one of {', '.join(OPT_LEVELS)} "
                "(O0 fp32, O1 precision lists, O2 everything but deny ops and pinned modules, "
                "O3 everything)"
            )
        self.amp_opt_level = level

    def override_amp_lists(
        self,
        *,
        allow: Iterable[Any] = (),
        deny: Iterable[Any] = (),
        infer: Iterable[Any] = (),
        clear: Iterable[Any] = (),
        remove: Iterable[Any] = (),
    ) -> None:
        """Move ops into a precision list (out of any other), or ``remove`` them from all lists.

        Ops are named as ``torch.ops.aten.gelu``, ``"aten.gelu"`` or ``"gelu"``. Names are checked
        here: an op that does not exist raises at once.
        """
        from .passes.lists import resolve_op

        groups = {"allow": allow, "deny": deny, "infer": infer, "clear": clear, "remove": remove}
        resolved = {k: tuple(resolve_op(op) for op in v) for k, v in groups.items()}
        seen: dict[Any, str] = {}
        for kind, ops in resolved.items():
            for op in ops:
                if op in seen and seen[op] != kind:
                    raise ConfigError(f"{op} is named in both {seen[op]!r} and {kind!r}")
                seen[op] = kind
        old = self.list_overrides
        # A later override of the same op wins over an earlier one.
        kept = {k: tuple(op for op in getattr(old, k) if op not in seen) for k in groups}
        self.list_overrides = ListOverrides(**{k: kept[k] + resolved[k] for k in groups})

    def pin_fp32(self, *modules: type | str) -> None:
        """Keep every op inside these modules in fp32: module classes or qualified names.

        Qualified names are paths from the Graph, e.g. ``"model.head"`` for ``self.model.head``;
        they are checked against the registered modules at the first call.
        """
        for m in modules:
            if isinstance(m, type) and issubclass(m, torch.nn.Module):
                self.fp32_module_types += (m,)
            elif isinstance(m, str) and m:
                self.fp32_module_names += (m,)
            else:
                raise ConfigError(
                    f"pin_fp32 takes nn.Module classes or qualified module names, got {m!r}"
                )

    # -- compile -------------------------------------------------------------------------------
    def set_backend(self, backend: str) -> None:
        """torch.compile backend for the step: "inductor" (default), "aot_eager" or "eager"."""
        if backend not in BACKENDS:
            raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.backend = backend

    def enable_cuda_graph(self, mode: bool = True) -> None:
        """Replay the compiled step as a CUDA graph (default on for CUDA with static shapes)."""
        if not isinstance(mode, bool):
            raise ConfigError(f"enable_cuda_graph(mode) takes True or False, got {mode!r}")
        self.cuda_graph = mode

    def set_inductor_options(self, **options) -> None:
        """Options for the inductor backend (``torch._inductor.config`` names), e.g.
        ``combo_kernels=True``. Unknown names raise at once."""
        import torch._inductor.config as inductor_config

        for name in options:
            if not hasattr(inductor_config, name.split(".")[0]):
                raise ConfigError(f"torch._inductor.config has no option {name!r}")
        self.inductor_options = {**self.inductor_options, **options}

    def enable_data_parallel(self, mode: bool = True, *, process_group=None) -> None:
        """Data parallel on torch.distributed: gradients are averaged over the ranks of
        ``process_group`` (default: the world) inside the compiled step, every rank skips the
        same overflow steps, and rank 0's parameters and buffers are broadcast at the first call.
        Start the processes with torchrun and call torch.distributed.init_process_group first."""
        import torch.distributed as dist

        if mode and not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "enable_data_parallel needs an initialised process group: start the script with "
                "torchrun and call torch.distributed.init_process_group(backend) before building "
                "the graph")
        self.data_parallel = bool(mode)
        self.process_group = process_group

    def set_gradient_accumulation_steps(self, n: int) -> None:
        """Split each call's batch into ``n`` micro-batches and take one optimizer step."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"gradient accumulation steps must be an int >= 1, got {n!r}")
        self.grad_acc_steps = n

    def set_max_cached_graphs(self, n: int) -> None:
        """How many input signatures keep a compiled step; the least recently used is dropped."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"max cached graphs must be an int >= 1, got {n!r}")
        self.max_cached_graphs = n

    # -- what the AMP passes read ----------------------------------------------------------------
    @property
    def amp_active(self) -> bool:
        return self.amp_enabled and self.amp_opt_level != "O0"

    def amp_key(self) -> tuple:
        """Everything about AMP that changes the captured graph (part of the cache key)."""
        o = self.list_overrides
        return (
            self.amp_active,
            self.amp_dtype,
            self.amp_opt_level,
            (o.allow, o.deny, o.infer, o.clear, o.remove),
            self.fp32_module_types,
            self.fp32_module_names,
            tuple(sorted(self.inductor_options.items())),
            self.data_parallel,
        )

    def __repr__(self) -> str:
        amp = f"{self.amp_dtype} {self.amp_opt_level}" if self.amp_active else "off"
        return (
            f"GraphConfig(amp={amp}, backend={self.backend!r}, cuda_graph={self.cuda_graph}, "
            f"grad_acc_steps={self.grad_acc_steps})"
        )
