"""torch's fused Adam/AdamW kernel as one op of the step: ``graphamp::fused_adam_``.

An ``Adam``/``AdamW`` built with ``fused=True`` runs ``torch._fused_adam_`` /
``torch._fused_adamw_`` eagerly: one kernel over every tensor of a group. The step calls the same
kernel, so the run is the eager fused optimizer's, and the update costs the compiler nothing:
written as multi-tensor math instead, inductor lowers it into a loop per parameter (2,300 more
nodes on a 12-layer GPT-2, and most of the gap between graphamp's cold first call and
torch.compile's on the CPU: ``benchmarks/results/first_call_cpu.md``).

Why a graphamp op and not torch's own: functionalization turns an aten op that writes its inputs
into its out-of-place twin (``_fused_adamw``), which copies every parameter and state tensor
before the kernel and writes them back after it. A custom op that declares what it writes is
wrapped in ``auto_functionalized`` instead, which inductor turns back into the in-place call on
the step's own parameter and state inputs, with no copy.

The learning rate is a tensor (a step input: a scheduler never recompiles): on a GPU the
kernel's ``tensor_lr`` overload reads it on the device; on the CPU it is a float64 input read as
the number eager passes; beta1, beta2, eps and the weight decay are the kernel's float arguments,
baked into the step and part of its key (``records.update_paths.UpdatePath.flags``), so changing one
builds the step again. ``found_inf`` (1.0 for a skipped step) makes the kernel leave the
parameters and state as they were, as it does under ``torch.amp.GradScaler``.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._fused_adam_, torch._fused_adamw_
import torch
from torch import Tensor


# The op's kernel and fake kernel: ``torchkit/ops.py`` registers them (the package's one
# import-time registration), with what the op writes.
def fused_adam_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    lr: Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
    found_inf: Tensor | None,
) -> None:
    """One fused Adam (``decoupled``: AdamW) step over lists of tensors on one device, steps
    already counted. The kernel writes the parameters and state in place (the grads too, when
    it unscales them: never here, the step has unscaled them already)."""
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    # on the CPU the lr is a float64 input (OptimizerPlan.hyper_inputs), passed as the number
    # eager passes; a device kernel reads its float32 tensor itself (no host read)
    lr_arg = float(lr) if lr.device.type == "cpu" else lr
    kernel(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        steps,
        lr=lr_arg,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=amsgrad,
        maximize=maximize,
        found_inf=found_inf,
    )


def fused_adam_fake(*_args: object, **_kwargs: object) -> None:
    """The op writes its inputs and returns nothing."""
    return None
