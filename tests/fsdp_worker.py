"""Run by tests/test_zero.py under torchrun (2 processes, gloo): what graphamp refuses of a model
wrapped with FSDP2's fully_shard, and an eval Graph over such a model.

Writes rank{r}.pt: for each refused setting the error graphamp raised (or "" when it raised
none), and the logits of an eval Graph over a wrapped model beside the unwrapped model's.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_worker import leave, make_model

import graphamp


class Train(graphamp.Graph):
    def __init__(self, model, *, zero=False):
        super().__init__()
        if zero:  # asked before the wrapped model is registered: refused there
            self.config.enable_zero(stage=2)
        self.model = model
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        self.config.set_backend("aot_eager")

    def build(self, x, y):
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


class Eval(graphamp.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config.set_backend("aot_eager")

    def build(self, x):
        return self.model(x)


def wrapped(**kwargs) -> nn.Module:
    model = make_model(seed=0)
    fully_shard(model, **kwargs)
    return model


def error_of(make) -> str:
    """The error graphamp raised making and calling a Graph ("" when none)."""
    try:
        make()(torch.randn(8, 32), torch.randint(0, 4, (8,)))
    except graphamp.GraphampError as e:
        return f"{type(e).__name__}: {e}"
    return ""


def main():
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    bf16 = torch.bfloat16
    refused = wrapped(mp_policy=MixedPrecisionPolicy(output_dtype=bf16))
    kept = wrapped()
    amp_off = wrapped(mp_policy=MixedPrecisionPolicy(param_dtype=bf16))
    result = {
        "output_dtype": error_of(lambda: Train(refused)),
        "reduce_dtype": error_of(
            lambda: Train(wrapped(mp_policy=MixedPrecisionPolicy(reduce_dtype=bf16)))
        ),
        "enable_zero": error_of(lambda: Train(kept, zero=True)),
        # param_dtype=bf16 and the Graph's AMP left off: refused at the first call
        "amp_off": error_of(lambda: Train(amp_off)),
    }
    # a refused model is left as the user wrapped it, at registration or at the first call,
    # and FSDP2 itself still trains it
    result["still_wrapped"] = [isinstance(m, FSDPModule) for m in (refused, kept, amp_off)]
    loss = nn.functional.cross_entropy(amp_off(torch.randn(8, 32)), torch.randint(0, 4, (8,)))
    loss.backward()
    result["fsdp_grads"] = all(p.grad is not None for p in amp_off.parameters())
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        result["eager_logits"] = make_model(seed=0)(x)
    result["eval_logits"] = Eval(wrapped())(x)
    torch.save(result, os.path.join(sys.argv[1], f"rank{dist.get_rank()}.pt"))
    leave()


if __name__ == "__main__":
    main()
