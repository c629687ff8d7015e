"""GraphConfig: verb-named setters in the style of OneFlow's ``nn.Graph.config``.

One config object per Graph; no globals, no environment variables. Every setter validates its
input at once, so a bad value fails where it is written, not at the first call. The stages never
read this mutable object: the Graph hands them ``snapshot()``, a frozen
``records.settings.ConfigSnapshot`` taken when a step is built (and part of the compiled-step
cache key, so a setter called later rebuilds the step).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._inductor
import dataclasses
from typing import Any, Iterable

import torch

from .errors import ConfigError
from .records.fully_shard import FullyShardWrap
from .records.pins import AmpPin
from .records.settings import BACKENDS, AutofixSettings, ConfigSnapshot, ListOverrides
from .records.validate import (
    LOW_PRECISION_DTYPES,
    OPT_LEVELS,
    check_bool,
    check_choice,
    check_int,
    check_low_precision_dtype,
    check_opt_level,
)
from .torchkit.fp8_numerics import RECIPES as FP8_RECIPES
from .torchkit.ops import resolve_op

_ZERO_BESIDE_FULLY_SHARD = (
    "enable_zero beside a model wrapped with fully_shard: the wrap already makes the step ZeRO-3 "
    "over its mesh (graphamp takes FSDP2's wrap over). Call one of the two: keep the wrap and "
    "drop enable_zero, or register the unwrapped model with enable_zero"
)

__all__ = [
    "AutofixSettings",
    "BACKENDS",
    "ConfigSnapshot",
    "GraphConfig",
    "ListOverrides",
    "LOW_PRECISION_DTYPES",
    "OPT_LEVELS",
]


class GraphConfig:
    """Settings of one Graph, set with verb-named setters; stages read ``snapshot()``."""

    def __init__(self) -> None:
        self._snapshot = ConfigSnapshot(
            amp_enabled=False,
            amp_dtype=torch.float16,
            amp_opt_level="O1",
            list_overrides=ListOverrides(),
            fp32_module_types=(),
            fp32_module_names=(),
            backend="inductor",
            cuda_graph=None,
            grad_acc_steps=1,
            inductor_options=(),
            data_parallel=False,
            process_group=None,
        )
        self.max_cached_graphs = 8
        self.autofix: AutofixSettings | None = None
        self.dynamic_shapes: bool | None = None  # automatic (set_dynamic_shapes)
        self.recompile_limit = 8
        self.progress = True  # not part of the snapshot: it changes no compiled step
        self.keep_cpu_memory = True  # nor this: it changes malloc, not the step

    def snapshot(self) -> ConfigSnapshot:
        """The current settings, frozen (the same object until a setter changes something)."""
        return self._snapshot

    def _set(self, **values: Any) -> None:
        self._snapshot = dataclasses.replace(self._snapshot, **values)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not attributes: the settings, read-only
        # (config.backend, config.amp_dtype, config.amp_active, ...).
        snapshot = self.__dict__.get("_snapshot")
        if snapshot is not None and hasattr(snapshot, name):
            return getattr(snapshot, name)
        raise AttributeError(f"GraphConfig has no setting {name!r}")

    # -- AMP -----------------------------------------------------------------------------------
    def enable_amp(self, mode: bool = True, *, dtype: torch.dtype = torch.float16) -> None:
        """Run the step in mixed precision: ``dtype`` is torch.float16 (default) or torch.bfloat16."""
        self._set(
            amp_enabled=check_bool("enable_amp(mode)", mode),
            amp_dtype=check_low_precision_dtype("enable_amp(dtype", dtype),
        )

    def enable_fp8(
        self,
        mode: bool = True,
        *,
        recipe: str = "tensorwise",
        keep: Iterable[str] = (),
        keep_first_last: bool = True,
        history: int = 16,
        margin: int = 0,
    ) -> None:
        """fp8 matmuls on top of bf16 AMP (``enable_amp(True, dtype=torch.bfloat16)``): the
        linear layers' matmuls run in float8. ``recipe``: ``"tensorwise"`` (one scale per
        tensor from its amax; e4m3 forward, e5m2 gradients), ``"rowwise"`` (a scale per row /
        column, e4m3) or ``"delayed"`` (Transformer Engine's: tensorwise formats, each scale
        from the amax history of the last ``history`` steps, divided by ``2**margin``; the
        histories are step state: in ``g.state_dict()``, untouched by a skipped step, agreed
        across ranks). ``keep``: module paths whose matmuls stay bf16; ``keep_first_last``:
        the input projection (a linear layer reading g(...)'s input) and the output layer (the
        last matmul) stay bf16 (the precision report says why each matmul is where it is)."""
        mode = check_bool("enable_fp8(mode)", mode)
        recipe = check_choice("enable_fp8(recipe", recipe, FP8_RECIPES)
        paths = tuple(keep)
        if not all(isinstance(p, str) for p in paths):
            raise ConfigError(f"enable_fp8(keep=...) takes module paths (strings), got {paths!r}")
        self._set(
            fp8_recipe=recipe if mode else None,
            fp8_keep=paths,
            fp8_keep_first_last=check_bool("enable_fp8(keep_first_last)", keep_first_last),
            fp8_history=check_int("enable_fp8(history)", history, at_least=1),
            fp8_margin=check_int("enable_fp8(margin)", margin, at_least=0),
        )

    def set_amp_opt_level(self, level: str) -> None:
        """apex-style opt level: O0 off, O1 lists (default), O2 all but deny/pinned, O3 all."""
        self._set(amp_opt_level=check_opt_level(level))

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
        self._set(list_overrides=ListOverrides(**{k: kept[k] + resolved[k] for k in groups}))

    def set_fp32_where_faster(self, mode: bool = True) -> None:
        """Keep an op fp32 where its fp32 kernel measured faster than its low-precision one on
        this machine, at the op's sizes (on by default; CPU steps only). Scaled-dot-product
        attention, matrix products and convolutions are the ops timed: on the CPU attention's
        bf16 backward measured several times slower than fp32 at small language models' sizes
        (``benchmarks/attention_precision.py``), and faster at long sequences; on a CPU
        without bf16 or fp16 instructions (AVX2 only) every low-precision product is the slow
        one, by 10-60x (``passes/dense_ops.py``), so there the step runs at fp32's speed where
        autocast's runs at the slow kernels'. Each such op is timed once per size on a machine, in both
        precisions (the timings are kept in ``fp32_where_faster.json`` under graphamp's cache
        directory, so every later run makes the same choice), and kept fp32 where fp32 took at
        most 5/6 of the time; calls too small to time reliably, or so large that timing would
        cost seconds, are not timed. The precision report says why. fp32 is never less
        accurate. Attention without a mask is timed a third way, written as low-precision
        matmuls around an fp32 softmax (``graphamp.sdpa_as_matmuls``; where the step is
        compiled by inductor, which fuses its casts into the softmax, its products and
        softmax are what is timed), and runs so where that took at most 5/6 of both kernels' time
        (it rounds as the low-precision kernel does). Ops named in ``override_amp_lists``
        keep the user's choice; off at opt level O3 and across more than one rank (ranks must
        trace the same graph). ``False``: the lists alone decide, as torch.autocast does."""
        self._set(fp32_where_faster=check_bool("set_fp32_where_faster(mode)", mode))

    def pin_fp32(self, *modules: type | str | AmpPin) -> None:
        """Keep every op inside these modules in fp32: module classes or qualified names; or
        single ops, as ``graphamp.AmpPin(module, op, index)`` (what autofix pins and
        ``amp_pins`` lists, so an automatic pin can be written into the code).

        Qualified names are paths from the Graph, e.g. ``"model.head"`` for ``self.model.head``;
        they are checked against the registered modules at the first call.
        """
        types, names, pins = self.fp32_module_types, self.fp32_module_names, self.amp_pins
        for m in modules:
            if isinstance(m, type) and issubclass(m, torch.nn.Module):
                types += (m,)
            elif isinstance(m, str) and m:
                names += (m,)
            elif isinstance(m, AmpPin):
                pins += (m,) if m not in pins else ()
            else:
                raise ConfigError(
                    f"pin_fp32 takes nn.Module classes, qualified module names or "
                    f"graphamp.AmpPin, got {m!r}"
                )
        self._set(fp32_module_types=types, fp32_module_names=names, amp_pins=pins)

    def clear_amp_pins(self, *pins: AmpPin) -> None:
        """Remove these AmpPins (all of them when none is given); the next call rebuilds the
        step without them. Module classes and names given to pin_fp32 stay."""
        for pin in pins:
            if pin not in self.amp_pins:
                raise ConfigError(f"{pin} is not pinned; amp_pins holds {list(self.amp_pins)}")
        kept = tuple(p for p in self.amp_pins if pins and p not in pins)
        self._set(amp_pins=kept)

    # -- overflow forensics ---------------------------------------------------------------------
    def enable_overflow_tracing(self, mode: bool = True) -> None:
        """Record, inside the step and without a host sync, which node first produced a
        non-finite value when a step overflows (``g.overflow_report()``), and the running
        largest magnitude of every value and gradient (``g.range_report()``). Off by default:
        when off, the compiled step has nothing of it."""
        mode = check_bool("enable_overflow_tracing(mode)", mode)
        if not mode and self.autofix is not None:
            raise ConfigError(
                "AMP autofix needs overflow tracing: call "
                "enable_amp_autofix(False) before enable_overflow_tracing(False)"
            )
        self._set(overflow_tracing=mode)

    def enable_amp_autofix(self, mode: bool = True, *, max_pins: int = 4, after: int = 3) -> None:
        """Self-healing AMP: when the same low-precision op is the first to produce a non-finite
        value on ``after`` skipped steps, pin it to fp32 (its module, if pinning the op was not
        enough), log one INFO line per pin and rebuild the step at the next call; at most
        ``max_pins`` pins. Data faults (a non-finite input batch) and overflows the loss scale
        explains are never pinned. Turns overflow tracing on. ``amp_pins`` lists the pins and
        ``clear_amp_pins`` removes them; ``g.state_dict()`` keeps them."""
        if not check_bool("enable_amp_autofix(mode)", mode):
            self.autofix = None
            return
        self.autofix = AutofixSettings(
            check_int("enable_amp_autofix(max_pins)", max_pins, at_least=1),
            check_int("enable_amp_autofix(after)", after, at_least=1),
        )
        self._set(overflow_tracing=True)

    # -- memory --------------------------------------------------------------------------------
    def enable_activation_checkpointing(self, *modules: type | str) -> None:
        """Recompute these modules' activations in the backward instead of keeping them from
        the forward: module classes (every instance, e.g. ``GPT2Block``) or qualified names
        (``"model.blocks.0"``). Each instance is one region: only its inputs stay alive between
        forward and backward. Called with no argument, turns checkpointing off."""
        types: tuple[type, ...] = ()
        names: tuple[str, ...] = ()
        for m in modules:
            if isinstance(m, type) and issubclass(m, torch.nn.Module):
                types += (m,)
            elif isinstance(m, str) and m:
                names += (m,)
            else:
                raise ConfigError(
                    "enable_activation_checkpointing takes nn.Module classes or qualified "
                    f"module names (e.g. 'model.blocks.0'), got {m!r}"
                )
        self._set(checkpoint_module_types=types, checkpoint_module_names=names)

    # -- compile -------------------------------------------------------------------------------
    def set_backend(self, backend: str) -> None:
        """torch.compile backend for the step: "inductor" (default), "aot_eager" or "eager"."""
        self._set(backend=check_choice("backend", backend, BACKENDS))

    def enable_cuda_graph(self, mode: bool = True) -> None:
        """Replay the compiled step as a CUDA graph (default on for CUDA with static shapes)."""
        self._set(cuda_graph=check_bool("enable_cuda_graph(mode)", mode))

    def set_cuda_graph_sizes(self, n: int) -> None:
        """A dynamic step (one compiled step for many batch shapes, ``set_dynamic_shapes``) is
        replayed on CUDA as one CUDA graph per batch shape, captured the first time a shape
        comes (about one step's time); at most ``n`` are kept, the least recently used dropped.
        Memory: each graph keeps static copies of its batch and outputs; the graphs share one
        pool for intermediates, so it holds about the largest graph's activations. ``0`` runs
        dynamic steps without CUDA graphs (static steps keep theirs)."""
        self._set(cuda_graph_sizes=check_int("CUDA graph sizes", n, at_least=0))

    def set_inductor_options(self, **options) -> None:
        """Options for the inductor backend (``torch._inductor.config`` names), e.g.
        ``combo_kernels=True``. Unknown names raise at once. ``post_grad_custom_post_pass``
        replaces graphamp's own pass of that name (``torchkit/update_region.py``, which hands
        inductor the optimizer update as one node); ``None`` there turns it off."""
        import torch._inductor.config as inductor_config

        for name in options:
            if not hasattr(inductor_config, name.split(".")[0]):
                raise ConfigError(f"torch._inductor.config has no option {name!r}")
        merged = {**dict(self.inductor_options), **options}
        self._set(inductor_options=tuple(sorted(merged.items())))

    def enable_data_parallel(self, mode: bool = True, *, process_group=None) -> None:
        """Data parallel on torch.distributed: gradients are averaged over the ranks of
        ``process_group`` (default: the world) inside the compiled step, every rank skips the
        same overflow steps, and rank 0's parameters and buffers are broadcast at the first call.
        Start the processes with torchrun and call torch.distributed.init_process_group first."""
        import torch.distributed as dist

        mode = check_bool("enable_data_parallel(mode)", mode)
        if self._snapshot.fully_shard is not None:
            raise ConfigError(
                "enable_data_parallel: a registered model is wrapped with fully_shard, so the "
                "Graph already trains data parallel (ZeRO-3) over the wrap's mesh: leave it"
            )
        if mode and not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "enable_data_parallel needs an initialised process group: start the script with "
                "torchrun and call torch.distributed.init_process_group(backend) before building "
                "the graph"
            )
        self._set(data_parallel=mode, process_group=process_group)

    def enable_zero(
        self, mode: bool = True, *, stage: int = 1, reshard_after_forward: bool = True
    ) -> None:
        """ZeRO data parallel (OneFlow's ``config.enable_zero``): each rank keeps and updates
        only its shard of the optimizer state and of the fp32 parameters' update; gradients are
        reduce-scattered and the updated parameters all-gathered inside the compiled step.
        Stage 2 also reduce-scatters each micro-batch of gradient accumulation at once, so a
        rank only holds its gradient shard between micro-batches. Implies data parallel over
        the world (or the group given to ``enable_data_parallel``). ``optimizer.state_dict()``
        gathers torch's format on every rank (call it on every rank); loading one shards it.
        Stage 3 also shards the parameters themselves: between steps each rank holds its
        ``Shard(0)`` DTensor shard of every parameter (FSDP2's layout: torch's
        ``get_model_state_dict`` gathers them, and a DCP checkpoint of them loads into an FSDP2
        model); the step all-gathers them for the forward and backward and updates only the
        shards. ``reshard_after_forward=False`` (FSDP2's option) keeps each block's gathered
        parameters from its forward to its backward: one all-gather per block a step instead
        of two, for more memory held through the step."""
        mode = check_bool("enable_zero(mode)", mode)
        stage = check_choice("enable_zero(stage)", stage, (1, 2, 3))
        reshard = check_bool("enable_zero(reshard_after_forward)", reshard_after_forward)
        if self._snapshot.fully_shard is not None:
            raise ConfigError(_ZERO_BESIDE_FULLY_SHARD)
        if not reshard and stage != 3:
            raise ConfigError(
                f"enable_zero(stage={stage}, reshard_after_forward=False): only stage 3 shards "
                "the parameters, so only it gathers them for the forward; ask for stage=3"
            )
        if not mode:
            self._set(zero_stage=0, zero_reshard_after_forward=True)
            return
        if not self.data_parallel:
            self.enable_data_parallel(True)
        self._set(zero_stage=stage, zero_reshard_after_forward=reshard)

    def _adopt_fully_shard(self, wrap: FullyShardWrap) -> None:
        """A registered model wrapped with fully_shard (sharding/fsdp_adopt.py): ZeRO-3 over
        its mesh's group. Called by the Graph when the model is registered."""
        current = self._snapshot.fully_shard
        if current is None and self.zero_stage:
            raise ConfigError(_ZERO_BESIDE_FULLY_SHARD)
        if current is not None and current.group is not wrap.group:
            raise ConfigError(
                "two registered models are wrapped with fully_shard on different meshes; "
                "graphamp shards every parameter of a Graph over one process group"
            )
        if current is not None:
            wrap = current.merged(wrap)
        self._set(data_parallel=True, process_group=wrap.group, zero_stage=3, fully_shard=wrap)

    def set_gradient_accumulation_steps(self, n: int) -> None:
        """Split each call's batch into ``n`` micro-batches and take one optimizer step."""
        self._set(grad_acc_steps=check_int("gradient accumulation steps", n, at_least=1))

    def set_max_cached_graphs(self, n: int) -> None:
        """How many compiled steps are kept; the least recently used is dropped."""
        self.max_cached_graphs = check_int("max cached graphs", n, at_least=1)

    # -- shapes ----------------------------------------------------------------------------------
    def set_dynamic_shapes(self, mode: bool | None = None) -> None:
        """Which dimensions of g(...)'s tensors a compiled step treats as symbolic, serving every
        size, as ``torch.compile(dynamic=...)`` does:

        - ``None`` (the default, automatic): a dimension whose size changed between two calls
          becomes symbolic in one more compile, and every later size reuses that step;
          dimensions marked with ``torch._dynamo.mark_dynamic(x, dim)`` are symbolic from the
          first call;
        - ``False``: static; every new shape compiles its own step (a different shape never
          shares a step, marks are ignored);
        - ``True``: every dimension of every tensor argument is symbolic from the first call.

        Sizes 0 and 1 always get a step of their own, as under torch.compile. Existing compiled
        steps are kept; the setting decides what the next compile does."""
        if mode is not None and not isinstance(mode, bool):
            raise ConfigError(f"set_dynamic_shapes(mode): None, True or False, got {mode!r}")
        self.dynamic_shapes = mode

    def set_recompile_limit(self, n: int) -> None:
        """At most ``n`` compiled steps for one model and config (the same structure); the next
        compile raises RecompileLimitError naming what kept changing between calls (torch.compile
        stops compiling after 8 by default too)."""
        self.recompile_limit = check_int("recompile limit", n, at_least=1)

    # -- first call ------------------------------------------------------------------------------
    def set_outline_blocks(self, mode: bool = True) -> None:
        """Compile each distinct repeated block once: the forward and backward of N identical
        blocks of a ModuleList or Sequential (transformer layers, equal ResNet blocks) become N
        calls of one shared subgraph of the step, which stays one program; each block's
        backward recomputes the cheap values it reads, as the inlined step's kernels do. Blocks
        are found automatically; precision decisions are unchanged; bitwise against the
        inlined step in the CPU tests, with aot_eager and inductor.

        By default graphamp outlines only where the steady step measured as fast as inlined:
        CPU steps (benchmarks/outline_cost.py: within 2% plain, with activation checkpointing
        and with changing shapes). It inlines CUDA steps (GPT-2 124M on an H200: 1.03-1.04x
        the inlined step) and steps with gradient accumulation (1.02-1.03x on the CPU). ``True``
        outlines those too; ``False`` inlines every step. The outline stage's INFO line says
        what it did."""
        self._set(outline_blocks=check_bool("set_outline_blocks(mode)", mode))

    def set_block_updates(self, mode: bool = True) -> None:
        """Update each repeated block's parameters by one call of an optimizer kernel compiled
        once per distinct block, instead of one multi-tensor update over every parameter,
        which inductor compiles as a loop per parameter. Blocks outlined or inlined alike. By
        default graphamp does so on CPU steps without gradient accumulation, for blocks
        repeated at least 3 times that do at least 400 MFLOP of forward work each
        (step/block_work.py): the first call compiles much less (cold on the CPU, 0.85-1.00x
        torch.compile's first call outlined instead of 1.7-2.0x, the kernels compiled in a
        second process while the step compiles: benchmarks/results/first_call_cpu.md, round
        13; inlined, 0.57x the cold first call without them on a small-block GPT-2), and the
        steady step measured 1.004-1.022x the inlined step outlined on the GPT workloads and
        ViT-Ti (outline_cost_cpu.md). Each call costs a fixed 0.2-0.5 ms, so small blocks keep
        the multi-tensor update (a small-block GPT-2 measured 1.139x with them once its
        attention ran fp32: step/block_work.py). ``True`` takes blocks repeated only twice too
        (ResNet-18's pair: 1.02x the inlined step), on any device; ``False`` keeps the whole
        update one multi-tensor run. The values are the same either way (bitwise in the CPU
        tests)."""
        self._set(block_updates=check_bool("set_block_updates(mode)", mode))

    def set_step_cache(self, mode: bool = True) -> None:
        """Whether a first call saves the assembled step on disk and a restart loads it (on by
        default), skipping assembly and outlining: a new process still captures build(), runs
        the AMP passes and compiles (from inductor's caches). The entries live in
        ``graphamp/steps`` under inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``), keyed
        by everything the step is made from (the captured forward, plan, inputs, config, torch
        and graphamp versions); a damaged entry is ignored with a warning and rebuilt. Steps with
        a custom autograd Function, a GradScaler subclass or data-dependent sizes are not
        cached (the INFO line says why)."""
        self._set(step_cache=check_bool("set_step_cache(mode)", mode))

    def set_progress(self, mode: bool) -> None:
        """Whether a first call draws a progress line on stderr while a long compile runs
        (default on; only ever on a terminal). The per-stage INFO lines on the ``graphamp``
        logger are its level's business (``Graph.debug(0)`` hides them)."""
        self.progress = check_bool("set_progress(mode)", mode)

    def set_keep_cpu_memory(self, mode: bool) -> None:
        """Whether compiling a CPU step makes glibc's malloc keep freed memory in the process
        (default on; ``runner/host_memory.py``). A step frees and allocates the same buffers
        every time; glibc gave the large ones back to the OS and faulted them in again next
        step: thousands of page faults a step. With it, the outlined step ran 163.0 ms instead
        of 175.5 on ViT-Ti and 48.2 instead of 60.4 on ResNet-18 (``benchmarks/outline_cost.py``,
        ``benchmarks/results/outline_cost_cpu.md``). Process-wide and not undone once set: the
        process keeps its peak memory instead of giving it back between steps. Off: malloc is
        left as it is (a Graph that already set it in this process cannot unset it). Nothing
        on the GPU, musl, macOS or Windows."""
        self.keep_cpu_memory = check_bool("set_keep_cpu_memory(mode)", mode)

    def __repr__(self) -> str:
        amp = f"{self.amp_dtype} {self.amp_opt_level}" if self.amp_active else "off"
        extra = ", overflow_tracing=True" if self.overflow_tracing else ""
        if self.autofix is not None:
            extra += f", autofix(max_pins={self.autofix.max_pins}, after={self.autofix.after})"
        if self.amp_pins:
            extra += f", amp_pins={len(self.amp_pins)}"
        return (
            f"GraphConfig(amp={amp}, backend={self.backend!r}, cuda_graph={self.cuda_graph}, "
            f"grad_acc_steps={self.grad_acc_steps}{extra})"
        )
