"""Run by tests/test_zero.py under torchrun (2 processes, gloo): a model wrapped with FSDP2's
fully_shard, registered on a Graph. Writes rank{r}.pt with the error graphamp raised."""

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_worker import make_model

import graphamp


def main():
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    model = make_model(seed=0)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Sharded(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_backend("aot_eager")

        def build(self, x, y):
            loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

    result = {}
    try:
        Sharded()(torch.randn(8, 32), torch.randint(0, 4, (8,)))
    except graphamp.GraphampError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    torch.save(result, os.path.join(sys.argv[1], f"rank{dist.get_rank()}.pt"))
    # Every rank finishes its collectives and files before any tears gloo down:
    # a rank leaving early made its peer abort ("terminate called without an
    # active exception") in CI.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
