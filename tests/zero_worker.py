"""Run by tests/test_zero.py under torchrun (gloo, CPU): ZeRO-1/2 training and checkpoints.

    python -m torch.distributed.run --nproc_per_node=N tests/zero_worker.py STAGE ACC FIRST \
        LAST OUT_DIR [RESUME_FROM]

Trains steps FIRST..LAST-1 of the global batches of dist_worker (an inf in the last rank's
shard at POISON_STEP) with AdamW, clipping and a grad scaler, each rank on its slice of the
global batch; RESUME_FROM: a checkpoint directory written by an earlier run (any rank count).
Writes rank{r}.pt (parameters, optimizer state dict, skips, bytes of optimizer state held) and,
from rank 0, a checkpoint (model, optimizer.state_dict(), graph state) into OUT_DIR.
GRAPHAMP_TEST_FULLY_SHARD=blocks|root: the model is wrapped with FSDP2's fully_shard instead of
asking for enable_zero (STAGE 3 then). GRAPHAMP_TEST_NORM: the first layer is followed by a
LayerNorm in the same block. GRAPHAMP_TEST_FUSED=1: AdamW(fused=True).
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_worker import global_batches, leave, make_model

import graphamp

WIDTH, CLIP = 63, 1.0  # 63: parameters whose sizes do not divide by the rank count


def make_training(stage: int, acc: int, model: nn.Module, fused: bool | None = None):
    """``fused`` (default: GRAPHAMP_TEST_FUSED=1): AdamW(fused=True), torch's fused kernel."""
    if fused is None:
        fused = os.environ.get("GRAPHAMP_TEST_FUSED") == "1"
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, fused=fused or None)

    class Zero(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt, clip_grad_max_norm=CLIP)
            # the test's way to ask for inductor (the default is aot_eager)
            self.config.set_backend(os.environ.get("GRAPHAMP_TEST_BACKEND", "aot_eager"))
            if stage and not os.environ.get("GRAPHAMP_TEST_FULLY_SHARD"):
                # a fully_shard wrap makes it ZeRO-3; GRAPHAMP_TEST_KEEP: gathered once a step
                keep = bool(os.environ.get("GRAPHAMP_TEST_KEEP"))
                self.config.enable_zero(
                    stage=stage, **({"reshard_after_forward": False} if keep else {})
                )
            if acc > 1:
                self.config.set_gradient_accumulation_steps(acc)
            self.set_grad_scaler(graphamp.GradScaler(init_scale=256.0))
            if amp_dtype() is not None:
                self.config.enable_amp(True, dtype=amp_dtype())

        def build(self, x, y):
            loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

    return Zero(), opt


def amp_dtype() -> torch.dtype | None:
    """GRAPHAMP_TEST_AMP=bf16|fp16: the test's way to ask for AMP in that dtype."""
    amp = os.environ.get("GRAPHAMP_TEST_AMP")
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[amp] if amp else None


def fully_sharded(wrap: str) -> nn.Module:
    """The model wrapped with FSDP2's fully_shard as its docs do: each layer and then the root
    (``blocks``), or the root alone (``root``); every rank initialises it alike, as FSDP2 needs
    (it broadcasts nothing). With AMP, MixedPrecisionPolicy(param_dtype=the AMP dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model(seed=0, width=WIDTH)
    policy = MixedPrecisionPolicy(
        param_dtype=amp_dtype(),
        reduce_dtype=torch.float32,
    )
    if wrap == "blocks":
        for layer in (model[0], model[2]):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def batch_size(step: int) -> int:
    """The global batch of a step: 16, or with GRAPHAMP_TEST_SIZES (comma-separated sizes per
    step, the test's way to ask for a changing batch size) that many rows of it."""
    sizes = os.environ.get("GRAPHAMP_TEST_SIZES")
    return int(sizes.split(",")[step]) if sizes else 16


def state_bytes(opt) -> int:
    """Bytes of optimizer state tensors this process holds (counted)."""
    return sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )


def whole_state_dict(model: nn.Module, stage: int) -> dict:
    """The model's state dict with whole tensors: ZeRO-3's DTensor shards gathered by torch's
    own get_model_state_dict (a collective: every rank calls it)."""
    if stage != 3:
        return {k: v.clone() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def main():
    stage, acc, first, last, out_dir = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
    )
    resume = sys.argv[6] if len(sys.argv) > 6 else None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if os.environ.get("GRAPHAMP_TEST_CACHE_PER_RANK"):  # each rank its own step cache
        os.environ["GRAPHAMP_CACHE_DIR"] = os.path.join(os.environ["GRAPHAMP_CACHE_DIR"], str(rank))
    warnings.simplefilter("ignore")
    wrap = os.environ.get("GRAPHAMP_TEST_FULLY_SHARD")  # the test's way to ask for FSDP2
    if wrap:
        model = fully_sharded(wrap)
    else:  # each rank its own values: graphamp broadcasts rank 0's
        model = make_model(seed=rank, width=WIDTH)
    if os.environ.get("GRAPHAMP_TEST_NORM"):  # a first block of bf16 copies and fp32 norms
        model[0] = nn.Sequential(model[0], nn.LayerNorm(WIDTH))
    g, opt = make_training(stage, acc, model)
    if resume:
        ckpt = torch.load(os.path.join(resume, "ckpt.pt"), weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        g.load_state_dict(ckpt["graph"])
    for step, (x, y) in enumerate(global_batches()[first:last], start=first):
        x, y = x[: batch_size(step)], y[: batch_size(step)]
        shard = len(x) // world
        g(x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard])
    held = state_bytes(opt)
    full_opt = opt.state_dict()  # a collective: every rank calls it
    whole = whole_state_dict(model, stage)
    result = {
        "params": whole,
        "param_bytes": sum(
            getattr(p, "_local_tensor", p).numel() * p.element_size() for p in model.parameters()
        ),
        "opt": full_opt,
        "skipped": g.history.fetch()["skipped"],
        "state_bytes": held,
        "compiled_steps": len(g.compiled_steps),
        # the step's all-gathers of bf16 values (ZeRO-3 with AMP gathers the copies)
        "gathered_bf16": sum(
            1
            for n in g.compiled_steps[-1].step_graph.graph.nodes
            if "all_gather" in str(n.target) and n.meta["val"].dtype == torch.bfloat16
        ),
        # ...and of bytes: a block whose rows travel in several dtypes
        "gathered_bytes": sum(
            1
            for n in g.compiled_steps[-1].step_graph.graph.nodes
            if "all_gather" in str(n.target) and n.meta["val"].dtype == torch.uint8
        ),
        # all-gathers in the step: ZeRO-3 gathers each block for its forward and again for
        # its backward, unless kept
        "all_gathers": sum(
            1 for n in g.compiled_steps[-1].step_graph.graph.nodes if "all_gather" in str(n.target)
        ),
        # ZeRO-3's gather buckets (one per block)
        "gather_buckets": len(
            {
                n.meta["graphamp_gather"]
                for n in g.compiled_steps[-1].step_graph.graph.nodes
                if "graphamp_gather" in n.meta
            }
        ),
        # the stages the last build ran: a step loaded from the step cache was not assembled
        "stages": sorted(g.compiled_steps[-1].timings),
    }
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if rank == 0:
        torch.save(
            {"model": whole, "opt": full_opt, "graph": g.state_dict()},
            os.path.join(out_dir, "ckpt.pt"),
        )
    leave()


if __name__ == "__main__":
    main()
