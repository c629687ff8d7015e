"""Run by tests/test_distributed.py under torchrun (2 processes, gloo, CPU).

    python -m torch.distributed.run --nproc_per_node=2 tests/dist_worker.py MODE OUT_DIR

MODE: train (config.enable_data_parallel), ddp (the model registered wrapped in DDP), bf16,
mismatch (rank 1 builds a different model: every rank must raise, none may hang),
fp8_delayed (bf16 with the delayed fp8 recipe and a scaler: the amax histories must agree),
sam (SAM written in build(): the gradients it reads are averaged over the ranks first),
interrupt (rank 1 is interrupted before a step and stays alive: rank 0 must get an error within
the process group's timeout, with its state from before that step), failing_rank[_alive][_zero3]
(rank 1's batch has the wrong width at one step: each rank must raise in Python, rank 0 naming
rank 1; ``alive``: rank 1 catches its error and stays alive), rebuilding_rank_zero3 (rank 1's
batch has one row fewer at one step: it alone builds a new step), autofix (fp16 with AMP
autofix; only rank 1's shard overflows the first layer's matmul: every rank must pin it at the
same step and go on together).
"""

import datetime
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import graphamp

STEPS, GLOBAL_BATCH, POISON_STEP = 6, 16, 2
INTERRUPTED_STEP, TIMEOUT_S = 4, 5


def global_batches(poison=True):
    gen = torch.Generator().manual_seed(0)
    out = []
    for step in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 32, generator=gen)
        if step == POISON_STEP and poison:
            x[GLOBAL_BATCH - 1, 0] = float("inf")  # only in the last rank's shard
        out.append((x, torch.randint(0, 4, (GLOBAL_BATCH,), generator=gen)))
    return out


def make_model(seed, width=64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 4))


def overflowing_model(seed):
    """make_model with first-layer weights ~1e4 (fine in fp16): its matmul overflows fp16 on
    ``autofix_batches``' second half only."""
    model = make_model(seed)
    with torch.no_grad():
        model[0].weight.mul_(1e5)
    return model


def autofix_batches():
    """The global batches with the first half of each (rank 0's shard) scaled down to 1e-3 and
    the second half (rank 1's) up by 10: only rank 1's |x @ W| exceeds fp16's 65504."""
    out = []
    for x, y in global_batches(poison=False):
        x = x.clone()
        x[: GLOBAL_BATCH // 2] *= 1e-3
        x[GLOBAL_BATCH // 2 :] *= 10.0
        out.append((x, y))
    return out


def configure_autofix(g):
    g.config.enable_amp(True)
    g.config.enable_amp_autofix(after=2)


def make_dp_graph(mode, registered, opt):
    class DP(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = registered
            self.add_optimizer(opt)
            self.config.set_backend("aot_eager")
            if mode != "ddp":
                self.config.enable_data_parallel()
            if mode.endswith("zero3"):
                self.config.enable_zero(True, stage=3)
            if mode == "bf16":
                self.config.enable_amp(True, dtype=torch.bfloat16)
            else:
                if mode == "fp8_delayed":  # the first layer (16 rows a rank) in fp8
                    self.config.enable_amp(True, dtype=torch.bfloat16)
                    self.config.enable_fp8(True, recipe="delayed", keep_first_last=False)
                self.set_grad_scaler(graphamp.GradScaler(init_scale=256.0))
            if mode == "autofix":
                configure_autofix(self)

        def build(self, x, y):
            if mode == "sam":
                return sam_step(self.model, x, y)
            loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

    return DP()


def sam_step(model, x, y, rho=0.05):
    """SAM in build(): ascend along the gradient, backward there, come back; the optimizer
    then steps on the second gradient."""
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    params = list(model.parameters())
    with torch.no_grad():
        norm = torch.stack([p.grad.norm() for p in params]).norm()
        steps = [p.grad * (rho / (norm + 1e-12)) for p in params]
        for p, e in zip(params, steps):
            p.add_(e)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p, e in zip(params, steps):
            p.sub_(e)
    return loss


def local_batch(mode, x, y, rank, shard):
    xs, ys = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
    if mode == "fp8_delayed":  # fp8 matmuls need multiples of 16 rows
        xs, ys = torch.cat([xs, xs * 0.5]), torch.cat([ys, ys])
    return xs, ys


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    warnings.simplefilter("ignore")
    # different initial weights per rank: graphamp must broadcast rank 0's
    if mode == "autofix":
        model = overflowing_model(seed=rank)
    else:
        model = make_model(seed=rank, width=64 if mode != "mismatch" or rank == 0 else 48)
    opt = (
        torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9)  # its step() traced
        if mode == "rmsprop"
        else torch.optim.SGD(
            model.parameters(), lr=1e-6 if mode == "autofix" else 0.1, momentum=0.9
        )
    )
    registered = nn.parallel.DistributedDataParallel(model) if mode == "ddp" else model

    g = make_dp_graph(mode, registered, opt)
    shard = GLOBAL_BATCH // world
    result = {}
    if mode == "interrupt":
        return interrupted_rank(g, model, rank, shard, out_dir)
    if mode.startswith(("failing_rank", "rebuilding_rank")):
        return failing_rank(g, mode, rank, shard, out_dir)
    try:
        # without a scaler (bf16) nothing would skip the poisoned step
        batches = autofix_batches() if mode == "autofix" else global_batches(poison=mode != "bf16")
        for x, y in batches:
            g(*local_batch(mode, x, y, rank, shard))
        result["params"] = {k: v.clone() for k, v in model.state_dict().items()}
        result["pins"] = [(p.describe(), p.step) for p in g.config.amp_pins]
        result["skipped"] = g.history.fetch()["skipped"]
        result["scale"] = g.grad_scaler.get_scale() if g.grad_scaler else None
        result["fp8_histories"] = g.state_dict()["fp8_histories"]
    except graphamp.GraphampError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    leave()


def leave() -> None:
    """End this rank's process once every rank saved its results.

    Every rank finishes its collectives and files before any tears gloo down: a rank leaving
    early made its peer abort ("terminate called without an active exception") in CI. The
    process then ends without the interpreter's finalization: a rank that had saved everything
    still aborted there once (SIGABRT, same message, in one of nine runs of a 4-rank ZeRO
    test), which is how gloo's worker threads fail when objects they hold are freed during
    finalization (pytorch/pytorch#179291 describes it)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def interrupted_rank(g, model, rank, shard, out_dir):
    """Rank 1 stops calling at INTERRUPTED_STEP (as after a Ctrl-C in a notebook) and stays
    alive; rank 0 calls that step and must get an error, not wait for ever."""
    result = {}
    for step, (x, y) in enumerate(global_batches(poison=False)):
        if step == INTERRUPTED_STEP:
            if rank == 1:
                time.sleep(3 * TIMEOUT_S)  # alive, but not in the collective
                break
            before = {k: v.clone() for k, v in model.state_dict().items()}
            start = time.perf_counter()
            try:
                g(x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard])
            except Exception as e:  # recorded for the test
                result["error"] = f"{type(e).__name__}: {e}"[:500]
            result["waited_s"] = time.perf_counter() - start
            result["unchanged"] = all(
                torch.equal(before[k], v) for k, v in model.state_dict().items()
            )
            result["step_count"] = g.step_count
            break
        g(x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard])
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # the process group is broken: do not wait in its teardown


def failing_rank(g, mode, rank, shard, out_dir):
    """Rank 1 passes a batch of the wrong width at INTERRUPTED_STEP (a data bug on one rank):
    its call raises its own error in Python, and rank 0's, which ran the step it had, a graphamp
    error naming rank 1 within the process group's timeout. No rank may die in a collective."""
    result = {}
    for step, (x, y) in enumerate(global_batches(poison=False)):
        xs, ys = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
        if step == INTERRUPTED_STEP and rank == 1:
            if "rebuilding" in mode:  # a valid batch of 7 rows: rank 1 alone builds a step
                xs, ys = xs[:-1], ys[:-1]
            else:
                xs = xs[:, :-1]  # 31 features where the model takes 32
        start = time.perf_counter()
        try:
            g(xs, ys)
        except Exception as e:  # recorded for the test
            result["error"] = f"{type(e).__name__}: {e}"[:2000]
            result["waited_s"] = time.perf_counter() - start
            result["step"] = step
            if "alive" in mode and rank == 1:
                time.sleep(3 * TIMEOUT_S)  # caught, and alive: its peer waits for its timeout
            break
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # the process group is broken: do not wait in its teardown


if __name__ == "__main__":
    main()
