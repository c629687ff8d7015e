"""Run by tests/test_zero.py under torchrun (gloo, CPU): what ZeRO refuses, and that a refused
Graph leaves the model and optimizer as they were.

    python -m torch.distributed.run --nproc_per_node=2 tests/zero_refusals_worker.py

Each refusal raises on every rank at the first call with the words the test names; the model's
parameters and the optimizer's state are then unchanged, and the same model trains in a Graph
without ZeRO. Prints "refused: ..." lines for the test to read.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_worker import leave, make_model

import graphamp


def zero_graph(model: nn.Module, opt: torch.optim.Optimizer, grad_code: bool, zero: bool):
    class Zero(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_backend("eager")
            if zero:
                self.config.enable_zero(stage=2)
            else:
                self.config.enable_data_parallel()

        def build(self, x, y):
            loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            if grad_code:  # gradient code in build(): clipping by hand
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            return loss

    return Zero()


def refused(opt_class, grad_code: bool, error: type, words: str) -> None:
    model = make_model(0)
    opt = opt_class(model.parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state.items()}
    x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
    try:
        zero_graph(model, opt, grad_code, zero=True)(x, y)
    except error as e:
        assert words in str(e), str(e)
        print(f"refused: {opt_class.__name__} grad_code={grad_code}: {e}", file=sys.stderr)
    else:
        raise AssertionError(f"ZeRO with {opt_class.__name__}, grad_code={grad_code} ran")
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert opt.state.keys() == state_before.keys(), "the refused build added optimizer state"
    for p, was in state_before.items():  # Adagrad makes its state in __init__
        assert all(torch.equal(was[n], opt.state[p][n]) for n in was), "state changed"
    zero_graph(model, opt, grad_code, zero=False)(x, y)  # the same objects train without it
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def main():
    dist.init_process_group("gloo")
    refused(torch.optim.Adagrad, False, graphamp.UnsupportedOptimizerError, "not by rows")
    refused(torch.optim.AdamW, True, graphamp.CaptureError, "the Graph uses ZeRO")
    leave()


if __name__ == "__main__":
    main()
