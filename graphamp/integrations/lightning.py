"""A LightningModule whose training step runs through graphamp, under Lightning's Trainer.

Two changes to a LightningModule::

    from graphamp.integrations.lightning import GraphampModule

    class LitModel(GraphampModule):          # instead of L.LightningModule
        def training_loss(self, batch):      # instead of training_step: the forward and the loss
            x, y = batch
            return F.cross_entropy(self.model(x), y)

Why a module pattern (and not a precision plugin or a strategy): Lightning's automatic
optimization runs ``training_step`` and ``backward`` eagerly inside a closure that a plugin or
strategy must call, and a ``training_step`` logs, which a compiled step cannot replay. Lightning's
own pattern for a step done elsewhere is manual optimization, and this base class is that
pattern written once: ``training_step`` runs graphamp's step (forward, backward, clipping, scaler,
optimizer update as one program) on ``training_loss``, then logs with ``self.log`` and steps
the optimizers (which counts Lightning's steps; they find no gradients and change nothing) and
the lr schedulers Lightning was given, by their interval and frequency.

What graphamp captures is ``training_loss`` alone, on the registered LightningModule: the
model and the loss, never Lightning's bookkeeping (``self.log``, the trainer, the loop's
attributes Lightning writes on the module), which stays in ``training_step``, outside the
captured step. Keep ``training_loss`` free of ``self.log`` and of reads of ``self.trainer``: a
write there is refused at capture, and a read would be a value the step depends on.

Kept from Lightning: its Trainer, data, logging (``train_loss``, ``loss_scale``,
``skipped_steps``), callbacks, validation and checkpoints (graphamp's state rides in the
checkpoint under ``"graphamp"``). ``Trainer(precision=...)``: ``"32-true"``, ``"16-mixed"``
(graphamp's AMP and GradScaler) or ``"bf16-mixed"``; one device, or ``strategy="ddp"`` on
several (graphamp's step averages the gradients over DDP's processes, and shards with
``graph.config.enable_zero(stage=1|2|3)`` in ``configure_graph``: checkpoints then hold whole
tensors, and validation runs on gathered parameters), or ``ModelParallelStrategy
(tensor_parallel_size=1)`` with FSDP2's ``fully_shard`` in ``configure_model`` (graphamp takes
the wrap over as ZeRO-3); Lightning's FSDP (FSDP1) and DeepSpeed strategies are refused: they
wrap the model, which graphamp's step cannot run. Clipping: ``self.clip_grad_max_norm``
(``Trainer(gradient_clip_val=...)`` and ``accumulate_grad_batches`` are refused with graphamp's
equivalents, and a ``training_step`` of the user's that returns a loss without calling
``graphamp_step`` is refused at its first batch: a switch done halfway never trains nothing
in silence); graphamp's own options: override ``configure_graph(graph)``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import lightning.pytorch as pl
import torch

from ..errors import ConfigError
from ..graph import Graph
from ..scaler import GradScaler
from ..sharding.rows import holds_shards
from ..sharding.sharded_params import gathered_parameters

CHECKPOINT_KEY = "graphamp"
_PRECISIONS = {"32-true": None, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class LightningStep(Graph):
    """The step graphamp compiles for a GraphampModule: ``training_loss``, backward, update."""

    def __init__(self, module: GraphampModule, precision: str):
        super().__init__()
        self.module = module
        for optimizer in module.trainer.optimizers:
            self.add_optimizer(optimizer, clip_grad_max_norm=module.clip_grad_max_norm)
        dtype = _amp_dtype(precision)
        if dtype is not None:
            self.config.enable_amp(True, dtype=dtype)
        if dtype == torch.float16:
            self.set_grad_scaler(GradScaler())

    def build(self, batch: Any) -> torch.Tensor:
        loss = self.module.training_loss(batch)
        loss.backward()
        return loss


class GraphampModule(pl.LightningModule):
    """A LightningModule trained by graphamp (module docstring). Write ``training_loss``."""

    clip_grad_max_norm: float | None = None  # set in __init__ to clip after unscaling

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False  # the step is graphamp's
        self.graph: LightningStep | None = None  # made at the first training step
        self._graph_state: dict | None = None  # from a checkpoint, loaded into the new graph
        self._skipped: torch.Tensor | None = None
        self._graphamp_steps = 0  # graphamp_step calls: a training_step must make one
        self._eager_loop: contextlib.ExitStack | None = None  # ZeRO-3's wholes for an eager loop

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass's own ``training_step`` is checked after every call: one that returns a
        loss without calling ``graphamp_step`` trained nothing (a half-done switch)."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("training_step")
        if own is not None and not getattr(own, "_graphamp_checked", False):
            cls.training_step = _checked_training_step(own)  # type: ignore[method-assign]

    @property  # type: ignore[override]
    def trainer(self) -> pl.Trainer:
        return pl.LightningModule.trainer.fget(self)  # type: ignore[attr-defined]

    @trainer.setter
    def trainer(self, trainer: pl.Trainer | None) -> None:
        """Where the module meets its Trainer, before Lightning checks the run: Lightning's
        own clipping and accumulation options are refused here with graphamp's equivalents
        (Lightning's message would say to switch back to automatic optimization)."""
        if trainer is not None:
            _refuse_lightning_options(trainer)
        pl.LightningModule.trainer.fset(self, trainer)  # type: ignore[attr-defined]

    def training_loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} must define training_loss(self, batch): the forward and the "
            "loss of one batch (graphamp calls backward and updates the parameters)"
        )

    def configure_graph(self, graph: Graph) -> None:
        """Set graphamp's own options on the step's Graph when it is made (for instance
        ``graph.config.set_backend("aot_eager")``, ``graph.config.pin_fp32(...)``)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # noqa: ARG002 - Lightning's signature
        loss = self.graphamp_step(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def graphamp_step(self, batch: Any) -> torch.Tensor:
        """One optimizer step through graphamp; call it from your own ``training_step`` to log
        more. Logs ``loss_scale`` and ``skipped_steps`` (device values, no host sync)."""
        graph = self.graph if self.graph is not None else self._make_graph()
        self._graphamp_steps += 1
        loss = graph(batch)
        for optimizer in self._lightning_optimizers():
            optimizer.step()  # Lightning counts the step; no gradients, so nothing changes
        self._step_schedulers("step")
        row = graph.history.latest()
        self._skipped = row["skipped"] if self._skipped is None else self._skipped + row["skipped"]
        self.log("loss_scale", row["scale"])
        self.log("skipped_steps", self._skipped)
        return loss

    def on_train_epoch_end(self) -> None:
        if self._graphamp_steps == 0:
            raise ConfigError(
                f"{type(self).__name__}: a whole epoch went by without a call of "
                "self.graphamp_step(batch), so nothing was trained; write training_loss(self, "
                "batch) and let GraphampModule's training_step run it"
            )
        self._step_schedulers("epoch")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """graphamp's state rides along; under ZeRO-3 the checkpoint's ``state_dict`` holds
        the whole tensors (every rank gathers them here: Lightning calls this hook on every
        rank, and rank 0 writes), so it loads on any number of devices; a distributed
        checkpoint of ModelParallelStrategy keeps the shards it saves with DCP."""
        if self.graph is not None:
            checkpoint[CHECKPOINT_KEY] = self.graph.state_dict()
        if holds_shards(self) and not _saves_shards(self.trainer.strategy):
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            whole = get_model_state_dict(self, options=StateDictOptions(full_state_dict=True))
            checkpoint["state_dict"] = whole

    # Lightning's eager loops (validation, test, predict) run the module's forward: under
    # ZeRO-3 on the whole parameters, gathered on every rank once per loop. Trainer.validate,
    # test and predict after training gather from setup on (DDP's setup broadcasts them)
    def setup(self, stage: str) -> None:
        if stage != "fit":
            self._gather_for_eager_loop()

    def teardown(self, stage: str) -> None:
        if stage != "fit":
            self._release_eager_loop()

    def on_validation_epoch_start(self) -> None:
        self._gather_for_eager_loop()

    def on_validation_epoch_end(self) -> None:
        self._release_eager_loop()

    def on_test_epoch_start(self) -> None:
        self._gather_for_eager_loop()

    def on_test_epoch_end(self) -> None:
        self._release_eager_loop()

    def on_predict_epoch_start(self) -> None:
        self._gather_for_eager_loop()

    def on_predict_epoch_end(self) -> None:
        self._release_eager_loop()

    def _gather_for_eager_loop(self) -> None:
        if self._eager_loop is None and holds_shards(self):
            self._eager_loop = contextlib.ExitStack()
            self._eager_loop.enter_context(gathered_parameters(self))

    def _release_eager_loop(self) -> None:
        if self._eager_loop is not None:
            self._eager_loop.close()
            self._eager_loop = None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._graph_state = checkpoint.get(CHECKPOINT_KEY)
        if self.graph is not None and self._graph_state is not None:
            self.graph.load_state_dict(self._graph_state)

    def _make_graph(self) -> LightningStep:
        data_parallel, group = _data_parallel(self.trainer.strategy)
        # registering the module takes over the fully_shard wraps configure_model made
        # (ModelParallelStrategy): ZeRO-3 over their mesh, graphamp's own collectives
        graph = LightningStep(self, str(self.trainer.precision))
        if data_parallel and graph.config.fully_shard is None:
            # DDP's process group (or the data-parallel mesh of a model left unwrapped); its
            # gradient sync is graphamp's step's
            graph.config.enable_data_parallel(process_group=group)
        self.configure_graph(graph)
        if self._graph_state is not None:
            graph.load_state_dict(self._graph_state)
        self.graph = graph
        return graph

    def _lightning_optimizers(self) -> list:
        optimizers = self.optimizers()
        return list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]

    def _step_schedulers(self, interval: str) -> None:
        """What Lightning's automatic optimization does with ``configure_optimizers``'
        schedulers: each steps on its interval, every ``frequency`` steps or epochs."""
        trainer = self.trainer
        steps = self.graph.step_count if self.graph is not None else 0
        for config in trainer.lr_scheduler_configs:
            if config.interval != interval:
                continue
            count = steps if interval == "step" else trainer.current_epoch + 1
            if count % config.frequency:
                continue
            scheduler: Any = config.scheduler
            if not config.reduce_on_plateau:
                scheduler.step()
                continue
            metric = trainer.callback_metrics.get(str(config.monitor))
            if metric is None:
                raise ConfigError(
                    f"{type(self).__name__}: the ReduceLROnPlateau scheduler monitors "
                    f"{config.monitor!r}, which nothing logged; log it with self.log or change "
                    "the scheduler's 'monitor'"
                )
            scheduler.step(metric)


def _checked_training_step(step: Callable) -> Callable:
    @functools.wraps(step)
    def training_step(self: GraphampModule, *args: Any, **kwargs: Any) -> Any:
        before = self._graphamp_steps
        out = step(self, *args, **kwargs)
        if out is not None and self._graphamp_steps == before:
            raise ConfigError(
                f"{type(self).__name__}.training_step returned a loss without calling "
                "self.graphamp_step(batch): with GraphampModule the optimizer step is "
                "graphamp's, so this batch trained nothing. Move the forward and the loss into "
                "training_loss(self, batch) and delete training_step (or call "
                "loss = self.graphamp_step(batch) in it, then log); return None to skip a batch"
            )
        return out

    training_step._graphamp_checked = True  # type: ignore[attr-defined]
    return training_step


def _refuse_lightning_options(trainer: Any) -> None:
    """Lightning's clipping and accumulation act on a backward that graphamp's step holds."""
    if getattr(getattr(trainer, "state", None), "fn", None) != "fit":
        return
    clip = getattr(trainer, "gradient_clip_val", None)
    if clip:
        raise ConfigError(
            f"GraphampModule clips inside graphamp's step: remove Trainer(gradient_clip_val="
            f"{clip}) and set self.clip_grad_max_norm = {clip} in the module's __init__ (after "
            "unscaling, as Lightning's clipping is with 16-mixed)"
            + ("" if _clips_by_norm(trainer) else "; clipping by value has no graphamp equivalent")
        )
    steps = getattr(trainer, "accumulate_grad_batches", 1)
    if steps != 1:
        raise ConfigError(
            f"GraphampModule accumulates inside graphamp's step: remove Trainer("
            f"accumulate_grad_batches={steps}), give the DataLoader batches {steps} times "
            "larger and set graph.config.set_gradient_accumulation_steps("
            f"{steps}) in configure_graph(self, graph): each batch is split into {steps} "
            "micro-batches and one optimizer step is taken"
        )


def _clips_by_norm(trainer: Any) -> bool:
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    return str(getattr(algorithm, "value", algorithm) or "norm") == "norm"


def _data_parallel(strategy: Any) -> tuple[bool, Any]:
    """(Whether the step averages gradients over processes, over which group: None for the
    world). ``strategy="ddp"`` (or ``"ddp_spawn"``) on several devices: DDP's, the world;
    ``ModelParallelStrategy`` with ``tensor_parallel_size=1``, its data-parallel mesh (its
    ``configure_model`` wraps with FSDP2's ``fully_shard``, which graphamp takes over). Lightning's FSDP (FSDP1) and DeepSpeed
    strategies, and tensor parallelism, are refused: they spread the model in ways graphamp's
    step does not."""
    if isinstance(strategy, pl.strategies.SingleDeviceStrategy):
        return False, None
    if type(strategy) is pl.strategies.DDPStrategy:
        return strategy.world_size > 1, None
    if _is_model_parallel(strategy):
        mesh = strategy.device_mesh
        if mesh["tensor_parallel"].size() > 1:
            raise ConfigError(
                "GraphampModule under ModelParallelStrategy shards data parallel only (FSDP2's "
                f"fully_shard, taken over as ZeRO-3): tensor_parallel_size="
                f"{mesh['tensor_parallel'].size()} is not supported; set tensor_parallel_size=1"
            )
        return True, mesh["data_parallel"].get_group()
    raise ConfigError(
        f"GraphampModule cannot train under Trainer(strategy={type(strategy).__name__}): it "
        "wraps the model in a way graphamp's step cannot run. Use strategy='ddp' (with "
        "graph.config.enable_zero(stage=3) in configure_graph(self, graph) for FSDP's "
        "sharding), or ModelParallelStrategy(tensor_parallel_size=1) with FSDP2's fully_shard "
        "in configure_model (docs/distributed.md)"
    )


def _saves_shards(strategy: Any) -> bool:
    """ModelParallelStrategy(save_distributed_checkpoint=True) saves each rank's shards with
    torch.distributed.checkpoint: the state dict it made stays as it is (DTensor shards)."""
    return _is_model_parallel(strategy) and bool(
        getattr(strategy, "_save_distributed_checkpoint", True)
    )


def _is_model_parallel(strategy: Any) -> bool:
    model_parallel = getattr(pl.strategies, "ModelParallelStrategy", None)
    return model_parallel is not None and type(strategy) is model_parallel


def _amp_dtype(precision: str) -> torch.dtype | None:
    if precision not in _PRECISIONS:
        raise ConfigError(
            f"GraphampModule trains with Trainer(precision='32-true', '16-mixed' or "
            f"'bf16-mixed'), got precision={precision!r}: true half precision casts the model "
            "itself, which graphamp's fp32 master weights cannot share; use the '-mixed' form"
        )
    return _PRECISIONS[precision]
