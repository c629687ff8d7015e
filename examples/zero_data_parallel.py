"""Data parallel with ZeRO-sharded optimizer state and activation checkpointing.

    torchrun --nproc-per-node 2 examples/zero_data_parallel.py --tiny [--zero 0|1|2|3]
        [--fully-shard] [--checkpointing] [--accumulate N] [--steps N]

Every rank trains the same model on its slice of the global batch; with --zero, each rank
keeps only its shard of AdamW's state (reduce-scatter, update, all-gather inside the compiled
step); --zero 3 shards the parameters too (each rank holds a Shard(0) DTensor of each, and the
step gathers each Block's parameters where that Block runs); --fully-shard wraps the model
with FSDP2's fully_shard (each Block, then the root, bf16 param_dtype) instead, which graphamp
takes over as ZeRO-3 (no --zero then); with --checkpointing, every
Block's activations are recomputed in the backward. Each rank prints the bytes of parameters
and optimizer state it holds (counted), the step graph's counted memory and the median step
time. Without torchrun it runs as one process.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import graphamp
from graphamp.inspect.memory import step_memory


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small model, CPU, aot_eager")
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3))
    p.add_argument("--fully-shard", action="store_true", help="wrap with FSDP2's fully_shard")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    args = p.parse_args()
    distributed = "RANK" in os.environ
    cuda = torch.cuda.is_available() and not args.tiny
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    width, depth, batch = (64, 4, 64) if args.tiny else (1024, 8, 256)
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(width) for _ in range(depth)), nn.Linear(width, 10)).to(device)
    if distributed and args.fully_shard:  # as FSDP2's docs wrap: each block, then the root
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # = the Graph's AMP dtype
        for block in model[:depth]:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after the wrap, as FSDP2 asks

    class Train(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt, clip_grad_max_norm=1.0)
            self.config.enable_amp(True, dtype=torch.bfloat16)
            self.config.set_backend("aot_eager" if args.tiny else "inductor")
            if distributed and args.fully_shard:
                pass  # the wrap makes the step ZeRO-3 over its mesh
            elif distributed and args.zero:
                self.config.enable_zero(stage=args.zero)
            elif distributed:
                self.config.enable_data_parallel()
            if args.accumulate > 1:
                self.config.set_gradient_accumulation_steps(args.accumulate)
            if args.checkpointing:
                self.config.enable_activation_checkpointing(Block)

        def build(self, x, y):
            loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

    g = Train()
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range((args.steps or (6 if args.tiny else 50)) + 2):
        x = torch.randn(batch // world, width, generator=gen).to(device)
        y = torch.randint(0, 10, (batch // world,), generator=gen).to(device)
        start = time.perf_counter()
        loss = g(x, y)
        if cuda:
            torch.cuda.synchronize()
        if step >= 2:  # the first calls compile
            times.append(time.perf_counter() - start)
    held = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    # a ZeRO-3 parameter is a DTensor: the bytes this rank holds are its local shard's
    params = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    mem = step_memory(g.compiled_steps[-1].step_graph)
    print(
        f"rank {rank}/{world} zero={g.config.zero_stage} fully_shard={args.fully_shard} "
        f"checkpointing={args.checkpointing} accumulate={args.accumulate}: parameters held {param_bytes} bytes, optimizer state "
        f"{held} bytes; step graph "
        f"{mem}; {statistics.median(times) * 1e3:.1f} ms/step; loss {loss.item():.4f}",
        flush=True,
    )
    full = opt.state_dict()  # torch's format on every rank (a collective under ZeRO)
    if rank == 0:
        shapes = {k: tuple(v.shape) for k, v in full["state"][0].items()}
        print(f"rank 0: optimizer.state_dict() state[0] shapes {shapes}")
    if distributed:
        # Every rank finishes its collectives and files before any tears gloo down:
        # a rank leaving early made its peer abort ("terminate called without an
        # active exception") in CI.
        dist.barrier()
        dist.destroy_process_group()
        if not cuda:
            # gloo's worker threads can abort the process while the interpreter frees what
            # they hold at exit (SIGABRT after every result was printed: seen once here, in
            # 1 of 4 runs; pytorch/pytorch#179291): end without that finalization
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


if __name__ == "__main__":
    main()
