"""The transformers ``Trainer`` with its training steps run through graphamp.

One changed line in a Trainer script::

    from graphamp.integrations.transformers import Trainer   # instead of transformers' Trainer

Why a subclass (and not a callback): a callback sees the Trainer's events but cannot replace
its forward, backward and optimizer step, and graphamp runs those as one compiled program. The
subclass overrides the Trainer's own extension points and leaves its loop as it is (data,
callbacks, logging, evaluation, checkpoints, schedules):

- ``training_step`` collects an optimizer step's micro-batches and, at the last, runs the
  step: forward (the Trainer's own ``compute_loss``, captured), backward, clipping, the grad
  scaler and the optimizer update. The Trainer's later ``optimizer.step()`` then finds no
  gradients and changes nothing; its ``lr_scheduler.step()`` sets the next step's learning rate,
  which graphamp reads as an input (never recompiling), and is skipped after an overflow, as
  with accelerate's scaler.
- ``fp16=True`` / ``bf16=True`` turn on graphamp's AMP (with its ``GradScaler`` for fp16) in
  place of accelerate's autocast and scaler; evaluation runs under ``torch.autocast`` of the
  same dtype, as the stock Trainer's does.
- ``max_grad_norm`` clips inside the step, after unscaling; the logged ``grad_norm`` is the
  step's norm before clipping. Logs add ``loss_scale`` and ``skipped_steps`` (since the last
  log) beside the loss.
- Checkpoints hold ``graphamp_state.pt`` (``Trainer.graph.state_dict()``: scaler, counters,
  history) beside the scaler's usual place; ``resume_from_checkpoint`` loads it.
- Under ``torchrun`` / ``accelerate launch`` (``world_size > 1``) the step is data parallel:
  graphamp averages the gradients over the processes inside the step (accelerate's DDP wrapper
  only synchronises the start; its backward hooks never run).
- Options graphamp cannot honour raise ``ConfigError`` when the Trainer is made or training
  starts (``trainer_checks.py``).

Extension points of transformers 5's Trainer that this relies on besides the documented ones
(``training_step``, ``create_optimizer``, ``get_batch_samples``, ``log``,
``autocast_smart_context_manager``): ``_build_accelerator_args`` (accelerate's mixed precision
off), ``_clip_grad_norm`` / ``_get_grad_norm`` (the norm graphamp measured),
``_save_scaler`` / ``_load_scaler`` (graphamp's state in checkpoints), and accelerate's
``AcceleratedOptimizer._is_overflow`` (a skipped step leaves the lr schedule where it was).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
import transformers
from accelerate.optimizer import AcceleratedOptimizer

from ..errors import ConfigError, UnsupportedOptimizerError
from ..graph import Graph
from ..scaler import GradScaler
from ..sharding.rows import holds_shards
from ..sharding.sharded_params import gathered_parameters
from . import micro_batches
from .trainer_checks import (
    refuse_optimizer,
    refuse_ragged_accumulation,
    refuse_unsupported,
    zero_stage_for_fsdp,
)

log = logging.getLogger("graphamp")

# The Trainer's own methods this subclass overrides or calls (module docstring); tested with
# transformers 5.24. A release without one of them fails here, by name, not mid-training.
_TRAINER_HOOKS = (
    "training_step",
    "create_optimizer",
    "get_batch_samples",
    "compute_loss",
    "autocast_smart_context_manager",
    "_build_accelerator_args",
    "_clip_grad_norm",
    "_get_grad_norm",
    "_save_scaler",
    "_load_scaler",
    "_prepare_inputs",
)
_missing = [name for name in _TRAINER_HOOKS if not hasattr(transformers.Trainer, name)]
if _missing:
    raise ImportError(
        f"graphamp's Trainer needs transformers.Trainer's {', '.join(_missing)}, which "
        f"transformers {transformers.__version__} does not have; it is tested with transformers "
        "5.24 (pip install 'transformers>=5,<6')"
    )

STATE_FILE = "graphamp_state.pt"  # graphamp's state in each checkpoint folder
_AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class TrainerStep(Graph):
    """The training step graphamp compiles for a Trainer: the Trainer's ``compute_loss`` on one
    micro-batch, backward, then (graphamp's own) clipping, scaler and optimizer update."""

    def __init__(self, trainer: Trainer, model: nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.model = model
        args = trainer.args
        clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        self.add_optimizer(optimizer, clip_grad_max_norm=clip)
        dtype = _AMP_DTYPES.get(str(args.mixed_precision))
        if dtype is not None:
            self.config.enable_amp(True, dtype=dtype)
        if dtype == torch.float16:
            self.set_grad_scaler(GradScaler())
        if args.world_size > 1:  # torchrun / accelerate launch: accelerate made the group
            self.config.enable_data_parallel()
        if trainer.zero_stage:  # the Trainer's fsdp arguments (trainer_checks.py)
            self.config.enable_zero(stage=trainer.zero_stage)
        self.trainer = trainer  # not a module: not registered, only called in build()

    def build(self, inputs: dict, num_items: torch.Tensor | None) -> torch.Tensor:
        n = num_items[0] if num_items is not None else None
        loss = self.trainer.compute_loss(self.model, inputs, num_items_in_batch=n)
        if not isinstance(loss, torch.Tensor):
            raise ConfigError(
                f"{type(self.trainer).__name__}.compute_loss returned a "
                f"{type(loss).__name__}; with return_outputs=False it returns the loss tensor"
            )
        if self.trainer.loss_is_scaled_for_the_step(n):
            # the Trainer sums such losses over micro-batches; graphamp averages them
            loss = loss * self.config.grad_acc_steps
        loss.backward()
        return loss


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose training steps run through graphamp (module docstring).

    ``configure_graph``: called with the training step's Graph when it is made, to set
    graphamp's own options (``g.config.set_backend("aot_eager")``,
    ``g.config.enable_overflow_tracing()``, ``g.config.pin_fp32(...)``).
    """

    def __init__(
        self, *args: Any, configure_graph: Callable[[Graph], None] | None = None, **kwargs: Any
    ):
        self.configure_graph = configure_graph
        self.graph: TrainerStep | None = None  # made with the optimizer, when training starts
        self.zero_stage = 0  # from the fsdp arguments, read when the accelerator is made
        self._micro_batches: list[Mapping[str, Any]] = []
        self._step_size: int | None = None  # micro-batches in the current optimizer step
        self._num_items: Any = None
        self._skipped_since_log = 0
        super().__init__(*args, **kwargs)
        refuse_unsupported(self)

    # -- the step -------------------------------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        try:
            self.graph = TrainerStep(self, self._model(), _torch_optimizer(optimizer))
        except UnsupportedOptimizerError as e:
            raise refuse_optimizer(self.args.optim, e) from e
        if self.configure_graph is not None:
            self.configure_graph(self.graph)
        return optimizer

    def get_train_dataloader(self) -> Any:
        dataset: Any = self.train_dataset
        refuse_ragged_accumulation(
            self.args,
            len(dataset) if hasattr(dataset, "__len__") else None,
            list(self.label_names),
            getattr(getattr(self.model, "config", None), "problem_type", None),
        )
        return super().get_train_dataloader()

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple:
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._micro_batches, self._step_size, self._num_items = [], len(batches), num_items
        return batches, num_items

    def training_step(
        self, model: nn.Module, inputs: dict, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """Keep the micro-batch; at the optimizer step's last one, run the whole step."""
        graph = self._graph_for(model)
        model.train()
        self._micro_batches.append(dict(self._prepare_inputs(inputs)))
        if self._step_size is None:  # called outside the Trainer's loop: a step of one batch
            self._num_items = num_items_in_batch
        elif len(self._micro_batches) < self._step_size:
            return torch.zeros((), device=self.args.device)  # its loss comes with the last one
        batches, self._micro_batches, self._step_size = self._micro_batches, [], None
        batch = micro_batches.combine(batches, self._pad_values(), self._padding_side())
        rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
        num_items = micro_batches.per_row(self._num_items, rows, self.args.device)
        graph.config.set_gradient_accumulation_steps(len(batches))
        try:
            loss = graph(batch, num_items)
        except UnsupportedOptimizerError as e:  # found when its step was traced
            raise refuse_optimizer(self.args.optim, e) from e
        self._after_step(graph)
        return loss

    def loss_is_scaled_for_the_step(self, num_items: Any) -> bool:
        """The Trainer's rule: is compute_loss's loss already a share of the whole optimizer
        step's (normalised by its label count), rather than a micro-batch's mean?"""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled)
        return (self.model_accepts_loss_kwargs and num_items is not None) or (
            self.compute_loss_func is not None
        )

    def _model(self) -> nn.Module:
        if not isinstance(self.model, nn.Module):
            raise ConfigError("graphamp's Trainer needs a model (an nn.Module) before training")
        return self.model

    def _graph_for(self, model: nn.Module) -> TrainerStep:
        graph = self.graph
        if graph is None:
            raise ConfigError(
                "graphamp's Trainer has no training step yet: it is made with the optimizer "
                "(create_optimizer), which Trainer.train() calls first"
            )
        if self.accelerator.unwrap_model(model) is not graph.model:
            raise ConfigError(
                "graphamp's Trainer was handed a different model than the one its step was "
                "built for; build a new Trainer for a new model"
            )
        return graph

    def _after_step(self, graph: TrainerStep) -> None:
        """A step the scaler skipped leaves the lr schedule where it was (as accelerate's
        scaler does): one host read of the skip flag, with fp16 only."""
        if graph.grad_scaler is None:
            return
        skipped = bool(graph.history.latest()["skipped"].item())
        self._skipped_since_log += skipped
        if isinstance(self.optimizer, AcceleratedOptimizer):
            self.optimizer._is_overflow = skipped

    def _pad_values(self) -> dict[str, int | None]:
        tokenizer = self.processing_class
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        return micro_batches.pad_values(pad, getattr(tokenizer, "pad_token_type_id", 0))

    def _padding_side(self) -> str:
        return str(getattr(self.processing_class, "padding_side", "right"))

    # -- what the Trainer's loop reads after the step -------------------------------------------
    def _clip_grad_norm(self, model: nn.Module) -> Any:  # noqa: ARG002 - the Trainer's signature
        """The norm graphamp measured before clipping, on the device (logged as grad_norm)."""
        return self.graph.history.latest().get("grad_norm") if self.graph is not None else None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:  # noqa: ARG002 - the Trainer's signature
        return grad_norm  # without max_grad_norm graphamp measures no norm: none is logged

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.graph is not None:
            scaler = self.graph.grad_scaler
            logs = {
                **logs,
                "loss_scale": scaler.get_scale() if scaler is not None else 1.0,
                "skipped_steps": self._skipped_since_log,
            }
            self._skipped_since_log = 0
        super().log(logs, start_time)

    # -- mixed precision: graphamp's, not accelerate's ------------------------------------------
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"  # no autocast wrapper on the model, no accelerate scaler
        self.zero_stage = zero_stage_for_fsdp(self.args)
        args["fsdp_plugin"] = None  # graphamp's step shards (ZeRO), accelerate does not wrap
        return args

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> Any:
        """Evaluation and prediction (the Trainer's own forward passes) under torch.autocast of
        the training's dtype, as the stock Trainer's accelerate wrapper runs them."""
        dtype = _AMP_DTYPES.get(str(self.args.mixed_precision))
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.args.device.type, dtype=dtype, cache_enabled=cache_enabled)

    # -- the sharded model: evaluation and checkpoints --------------------------------------------
    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Evaluation runs the model eagerly: under ZeRO-3 on its whole parameters, gathered
        once per evaluation on every rank."""
        with self._whole_parameters():
            return super().evaluation_loop(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under ZeRO-3 every rank gathers the whole parameters (torch's get_model_state_dict,
        a collective) and the main process saves them, as the stock Trainer saves FSDP's."""
        if not holds_shards(self.model):
            return super().save_model(output_dir, _internal_call)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        whole = get_model_state_dict(self._model(), options=StateDictOptions(full_state_dict=True))
        if self.args.should_save:
            self._save(output_dir if output_dir is not None else self.args.output_dir, whole)
        return None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The stock save, with the model's config put back as it was: save_pretrained writes
        fields into it (architectures, dtype) on the saving process only, and build() reads
        the config, so the step would be rebuilt there alone (a data-parallel rank that
        rebuilds while the others step waits in a collective they never join)."""
        config = getattr(self.model, "config", None)
        kept = dict(vars(config)) if config is not None else None
        try:
            super()._save(output_dir, state_dict)
        finally:
            if config is not None and kept is not None:
                vars(config).clear()
                vars(config).update(kept)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Under ZeRO the optimizer holds its rows: every rank gathers torch's format (a
        collective), then the main process saves it where the stock Trainer does."""
        if not self.zero_stage or self.optimizer is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        gathered = self.optimizer.state_dict()
        self.optimizer.state_dict = lambda: gathered  # type: ignore[method-assign]
        try:
            super()._save_optimizer_and_scheduler(output_dir)
        finally:
            del self.optimizer.state_dict

    def _whole_parameters(self) -> Any:
        if not holds_shards(self.model):
            return contextlib.nullcontext()
        return gathered_parameters(self._model())

    # -- checkpoints ----------------------------------------------------------------------------
    def _save_scaler(self, output_dir: str) -> None:
        super()._save_scaler(output_dir)
        if self.graph is not None and self.args.should_save:
            torch.save(self.graph.state_dict(), os.path.join(output_dir, STATE_FILE))

    def _load_scaler(self, checkpoint: str | None) -> None:
        super()._load_scaler(checkpoint)
        path = os.path.join(checkpoint, STATE_FILE) if checkpoint is not None else None
        if path is None or self.graph is None:
            return
        if not os.path.isfile(path):
            log.info(
                "%s has no %s: graphamp's scaler and counters start afresh", checkpoint, STATE_FILE
            )
            return
        self.graph.load_state_dict(
            torch.load(path, weights_only=True, map_location=self.args.device)
        )


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's wrapper (graphamp updates its state)."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer
