"""What graphamp's Trainer cannot honour, refused when the Trainer is made or training starts.

Each entry names the ``TrainingArguments`` field (or the situation) and the alternative; the
Trainer raises ``ConfigError`` with it instead of ignoring the option. Kept apart from the
Trainer so the list reads as one table.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from ..errors import ConfigError, UnsupportedOptimizerError

_PARALLEL = (
    "graphamp's Trainer trains data parallel under torchrun or accelerate launch (one device "
    "per process), and shards with fsdp='full_shard' (graphamp's ZeRO-3) or 'shard_grad_op' "
    "(ZeRO-2) inside its step; it does not spread the model over devices otherwise "
    "(docs/distributed.md)"
)


class Refusal(NamedTuple):
    argument: str  # what the user set, as they wrote it
    applies: Callable[[Any], bool]  # (the trainer) -> the option is in use
    why_and_instead: str


REFUSALS = (
    Refusal(
        "torch_compile=True",
        lambda t: bool(getattr(t.args, "torch_compile", False)),
        "graphamp compiles the whole training step itself. Set torch_compile=False; choose "
        "graphamp's backend with Trainer(..., configure_graph=lambda g: "
        "g.config.set_backend('inductor'))",
    ),
    Refusal("deepspeed", lambda t: bool(getattr(t.args, "deepspeed", None)), _PARALLEL),
    Refusal(
        "parallelism_config",
        lambda t: getattr(t.args, "parallelism_config", None) is not None,
        _PARALLEL,
    ),
    Refusal(
        "several GPUs in one process (n_gpu > 1, DataParallel)",
        lambda t: t.args.n_gpu > 1,
        "graphamp trains on one device per process: make one GPU visible to the process",
    ),
    Refusal(
        "a model spread over several devices (model parallel)",
        lambda t: bool(getattr(t, "is_model_parallel", False)),
        "graphamp trains a model on one device: load it on one device",
    ),
    Refusal(
        "fp16_full_eval / bf16_full_eval",
        lambda t: bool(
            getattr(t.args, "fp16_full_eval", False) or getattr(t.args, "bf16_full_eval", False)
        ),
        "they cast the model itself to half precision, which graphamp's fp32 master weights "
        "cannot share. Evaluation already runs under the training's mixed precision (fp16=True "
        "or bf16=True)",
    ),
    Refusal(
        "neftune_noise_alpha",
        lambda t: getattr(t.args, "neftune_noise_alpha", None) is not None,
        "NEFTune adds its noise in a forward hook on the embeddings, which a compiled step "
        "cannot run. Leave neftune_noise_alpha unset",
    ),
    Refusal(
        "debug='underflow_overflow'",
        lambda t: "underflow_overflow" in str(getattr(t.args, "debug", "")),
        "it watches activations with forward hooks, which a compiled step cannot run. Use "
        "graphamp's overflow tracing instead: Trainer(..., configure_graph=lambda g: "
        "g.config.enable_overflow_tracing()), then trainer.graph.overflow_report()",
    ),
    Refusal(
        "use_liger_kernel=True",
        lambda t: bool(getattr(t.args, "use_liger_kernel", False)),
        "Liger replaces the model's layers with its own Triton kernels; graphamp captures and "
        "compiles the model's own ops. Leave use_liger_kernel off",
    ),
)


def zero_stage_for_fsdp(args: Any) -> int:
    """The ZeRO stage graphamp's step runs for the Trainer's ``fsdp`` arguments (0: none).

    transformers turns ``fsdp`` into ``fsdp_plugin_args`` for accelerate's FSDP; graphamp
    shards inside its own step instead (accelerate gets no FSDP plugin): FSDP2's
    ``reshard_after_forward=True`` (``fsdp='full_shard'``) is ZeRO-3, ``False``
    (``'shard_grad_op'``) ZeRO-2. In one process there is nothing to shard over: 0. What has
    no graphamp equivalent is refused by name."""
    plugin = getattr(args, "fsdp_plugin_args", None)
    if not plugin or args.world_size < 2:
        return 0
    if plugin.get("cpu_offload"):
        raise ConfigError(
            "graphamp's Trainer does not support fsdp 'offload' (cpu_offload): graphamp keeps "
            "each rank's shards on its device. Remove 'offload' from fsdp"
        )
    if plugin.get("activation_checkpointing"):
        raise ConfigError(
            "graphamp's Trainer does not support fsdp_config['activation_checkpointing']: "
            "graphamp recomputes inside its step instead. Remove it and pass Trainer(..., "
            "configure_graph=lambda g: g.config.enable_activation_checkpointing(BlockClass))"
        )
    if getattr(args, "load_best_model_at_end", False):
        raise ConfigError(
            "graphamp's Trainer does not support load_best_model_at_end with fsdp: loading a "
            "checkpoint into the sharded parameters after training is not written yet. Load "
            "the best checkpoint with from_pretrained after training"
        )
    reshard = plugin.get("reshard_after_forward", True)
    stages = {True: 3, False: 2, "full_shard": 3, "shard_grad_op": 2}
    if reshard not in stages:
        raise ConfigError(
            f"graphamp's Trainer does not support the FSDP sharding strategy {reshard!r}: it "
            "maps fsdp='full_shard' onto ZeRO-3 and 'shard_grad_op' onto ZeRO-2 inside its "
            "step (docs/distributed.md)"
        )
    return stages[reshard]


def refuse_unsupported(trainer: Any) -> None:
    """ConfigError naming the first option in use that graphamp's Trainer cannot honour."""
    for refusal in REFUSALS:
        if refusal.applies(trainer):
            raise ConfigError(
                f"graphamp's Trainer does not support {refusal.argument}: {refusal.why_and_instead}"
            )


def refuse_ragged_accumulation(
    args: Any, n_examples: int | None, label_names: list[str], problem_type: Any
) -> None:
    """With gradient accumulation graphamp runs an optimizer step's micro-batches as equal
    slices of one batch; a smaller last batch is grown with rows whose labels say "no loss"
    (``micro_batches``). Refused, before training, where no label can say that: a model
    trained without ``labels`` (question answering's positions) or on float labels."""
    steps, batch = args.gradient_accumulation_steps, args.per_device_train_batch_size
    if steps == 1 or args.dataloader_drop_last or n_examples is None or n_examples % batch == 0:
        return
    if 0 < args.max_steps and args.max_steps * steps <= n_examples // batch:
        return  # training stops before the epoch's last batch
    floats = problem_type in ("regression", "multi_label_classification")
    if "labels" in label_names and not floats:
        return
    why = f"its {problem_type} labels are floats" if floats else f"its labels are {label_names}"
    raise ConfigError(
        f"graphamp's Trainer does not support gradient_accumulation_steps={steps} with a "
        f"last batch of {n_examples % batch} examples (the dataset's {n_examples} examples "
        f"are not a multiple of per_device_train_batch_size={batch}): graphamp runs an "
        "optimizer step's micro-batches as equal slices of one batch and grows a smaller one "
        f"with rows whose integer 'labels' are -100, and {why}. Set "
        "dataloader_drop_last=True, or make the dataset a multiple of the batch size"
    )


def refuse_optimizer(optim: Any, error: Exception) -> UnsupportedOptimizerError:
    """The error for an optimizer graphamp has no in-graph update for."""
    name = getattr(optim, "value", optim)  # TrainingArguments holds an OptimizerNames enum
    return UnsupportedOptimizerError(
        f"graphamp's Trainer cannot train with optim={name!r}: {error}. Use an optimizer "
        "whose step is tensor arithmetic: optim='adamw_torch', 'adamw_torch_fused', 'sgd', "
        "'rmsprop', 'adagrad' (or pass any torch.optim optimizer but SparseAdam and "
        "Adafactor through Trainer(optimizers=(optimizer, scheduler)))"
    )
