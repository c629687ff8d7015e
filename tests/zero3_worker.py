"""Run by tests/test_zero.py under torchrun (gloo, CPU): ZeRO-3 on a model with what sharding
finds hard, and its checkpoint read by torch's own tools.

    python -m torch.distributed.run --nproc_per_node=N tests/zero3_worker.py OUT_DIR

The model (``TiedLM``) ties its head to its embedding (one parameter in two modules), has a
frozen layer, a parameter with fewer rows than ranks (3 on 4 ranks: one rank holds none) and
rows that do not divide by the rank count. Each rank trains its slice of the global batches
with AdamW and ZeRO-3, then writes rank{r}.pt: the whole parameters (torch's
get_model_state_dict), the bytes of parameters it holds, and the whole parameters of an FSDP2
model (fully_shard per block, then the root) that loaded graphamp's sharded checkpoint through
torch.distributed.checkpoint, the logits of the first batch from an eval Graph on the sharded
model and from an eager forward under graphamp.gathered_parameters, and, after the untrained
model's state dict is loaded into the shards with set_model_state_dict, its whole state and an
eval Graph's logits; then the trained DCP checkpoint loaded back into the shards in place.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_worker import leave

import graphamp
from graphamp.sharding.rows import is_shard

VOCAB, DIM, STEPS, BATCH = 11, 16, 3, 8


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.gate = nn.Parameter(torch.tensor([1.0, 0.5, -0.5]))  # 3 rows: fewer than 4 ranks
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter

    def forward(self, ids):
        h = self.frozen(self.embed(ids))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h * self.gate.sum())


def make_model() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM()


def global_batches():
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, 5), generator=gen),
            torch.randint(0, VOCAB, (BATCH, 5), generator=gen),
        )
        for _ in range(STEPS)
    ]


def make_training(model: nn.Module, zero: bool):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)

    class Train(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt, clip_grad_max_norm=1.0)
            self.config.set_backend("aot_eager")
            if zero:
                self.config.enable_zero(stage=3)

        def build(self, ids, targets):
            logits = self.model(ids)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            return loss

    return Train(), opt


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    warnings.simplefilter("ignore")
    model = make_model()
    g, _ = make_training(model, zero=True)
    for ids, targets in global_batches():
        n = len(ids) // world
        g(ids[rank * n : (rank + 1) * n], targets[rank * n : (rank + 1) * n])
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    class Evaluate(graphamp.Graph):  # an eval graph reading the shards: it gathers them too
        def __init__(self):
            super().__init__()
            self.model = model
            self.config.set_backend("aot_eager")

        def build(self, ids):
            return self.model(ids)

    ids = global_batches()[0][0]
    evaluated = Evaluate()(ids)
    with graphamp.gathered_parameters(model):  # eager, outside any Graph
        eager = model(ids).detach()
    shards_kept = all(hasattr(p, "device_mesh") for p in model.parameters())
    held = {n: p._local_tensor.numel() for n, p in model.named_parameters()}
    # graphamp's shards, saved as they are (DTensors) and loaded into an FSDP2 model
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(out_dir, "dcp"))
    from torch.distributed.fsdp import fully_shard

    fsdp = make_model()
    for block in fsdp.blocks:
        fully_shard(block)
    fully_shard(fsdp)
    loaded = fsdp.state_dict()
    dcp.load(loaded, checkpoint_id=os.path.join(out_dir, "dcp"))
    fsdp_whole = get_model_state_dict(fsdp, options=StateDictOptions(full_state_dict=True))
    # last, a whole state dict loaded into the shards with torch's set_model_state_dict: the
    # values land in the rows the step reads
    fresh = make_model().state_dict()
    # (torch puts the distributed tensors into the dict it is given: a copy)
    set_model_state_dict(model, dict(fresh), options=StateDictOptions(full_state_dict=True))
    reloaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    reloaded_logits = Evaluate()(ids)
    # and the trained shards' DCP checkpoint loaded back into the shards in place (the model
    # already sharded): its values land in the rows, which stay graphamp's shards
    in_place = model.state_dict()
    dcp.load(in_place, checkpoint_id=os.path.join(out_dir, "dcp"))
    dcp_reloaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    dcp_logits = Evaluate()(ids)
    result = {
        "params": whole,
        "held": held,
        "fsdp": fsdp_whole,
        "tied": model.head.weight is model.embed.weight,
        "evaluated": evaluated,
        "eager": eager,
        "shards_kept": shards_kept,
        "reloaded_equal": all(torch.equal(reloaded[k], v) for k, v in fresh.items()),
        "still_shards": all(is_shard(p) for p in model.parameters()),
        "reloaded_logits": reloaded_logits,
        "dcp_reloaded_equal": all(torch.equal(dcp_reloaded[k], v) for k, v in whole.items()),
        "dcp_still_shards": all(is_shard(p) for p in model.parameters()),
        "dcp_logits": dcp_logits,
    }
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    leave()


if __name__ == "__main__":
    main()
