"""OneFlow's AMP tutorial, in PyTorch with graphamp: enable_amp + GradScaler(3000, 2.0, 0.5, 1000).

python examples/oneflow_mlp.py            # GPU, 1000 steps
python examples/oneflow_mlp.py --tiny     # CPU, a few steps
"""

import torch
import torch.nn as nn
from _common import parse

import graphamp

args = parse(__doc__.splitlines()[0], steps=1000)
model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)).to(args.device)
model.train()
loss_fn = nn.CrossEntropyLoss().to(args.device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)


class CustomGraph(graphamp.Graph):
    def __init__(self):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.add_optimizer(optimizer)
        self.config.enable_amp(True)
        self.config.set_backend(args.backend)
        grad_scaler = graphamp.GradScaler(
            init_scale=3000, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000
        )
        self.set_grad_scaler(grad_scaler)

    def build(self, x, y):
        y_pred = self.model(x)
        loss = self.loss_fn(y_pred, y)
        loss.backward()
        return y_pred


graph_model = CustomGraph()
for _ in range(args.steps):
    x = torch.randn(128, 256).to(args.device)
    y = torch.ones(128, dtype=torch.int64).to(args.device)
    y_pred = graph_model(x, y)

print(graph_model)
print(graph_model.precision_report(with_autocast=False).summary())
print("loss scale:", graph_model.grad_scaler.get_scale(), "| predictions:", tuple(y_pred.shape))
