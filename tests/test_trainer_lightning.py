"""graphamp's GraphampModule under Lightning's Trainer against a stock LightningModule: the
same model, data, optimizer, schedule and clipping; fp32 losses equal, checkpoints resume."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

L = pytest.importorskip("lightning.pytorch")

from helpers import free_port  # noqa: E402

from graphamp import CaptureError, ConfigError  # noqa: E402
from graphamp.integrations import lightning as integration  # noqa: E402
from graphamp.integrations.lightning import CHECKPOINT_KEY, GraphampModule  # noqa: E402

STEPS = 20


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))


def _loader():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 8, 16, generator=g)
    y = (x[:, :4] * 3).argmax(1)
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)


def _optimizers(module):
    opt = torch.optim.AdamW(module.parameters(), lr=3e-2, weight_decay=0.1)
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}


class Stock(L.LightningModule):
    """The LightningModule a user has: automatic optimization."""

    def __init__(self):
        super().__init__()
        self.model = _model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return _optimizers(self)


class Ours(GraphampModule):
    """The same module on graphamp: training_loss instead of training_step, clipping here."""

    def __init__(self):
        super().__init__()
        self.model = _model()
        self.clip_grad_max_norm = 1.0

    def training_loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_graph(self, graph):
        graph.config.set_backend("aot_eager")

    def configure_optimizers(self):
        return _optimizers(self)


class Losses(L.Callback):
    """Lightning's logged values after every training batch (what a logger would see)."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.rows.append({k: float(v) for k, v in metrics.items()})


def _fit(module, tmp_path, epochs=1, ckpt_path=None, **trainer_args):
    losses = Losses()
    settings = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    callbacks = [losses, *trainer_args.pop("callbacks", [])]
    trainer = L.Trainer(**{**settings, **trainer_args}, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _loader(), ckpt_path=ckpt_path)
    return trainer, losses.rows


class StockReadingLr(Stock):
    """Weighs its loss by the lr its scheduler last set (as a loss that logs or uses it)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        lr = self.lr_schedulers().get_last_lr()[0]
        loss = F.cross_entropy(self.model(x), y) * (1.0 + lr)
        self.log("train_loss", loss)
        return loss


class OursReadingLr(Ours):
    def training_loss(self, batch):
        x, y = batch
        lr = self.lr_schedulers().get_last_lr()[0]
        return F.cross_entropy(self.model(x), y) * (1.0 + lr)


@pytest.mark.slow
def test_the_lr_read_off_the_scheduler_in_the_loss_is_each_steps_as_in_stock_lightning(tmp_path):
    """StepLR halves the lr every 4 steps: the loss read the first step's lr at every step
    (2.8% off stock Lightning's losses at worst); now each step's."""
    _, expected = _fit(StockReadingLr(), tmp_path / "stock", gradient_clip_val=1.0)
    _, rows = _fit(OursReadingLr(), tmp_path / "ours")
    assert len(rows) == len(expected) == STEPS
    for a, b in zip(rows, expected):
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-5 * abs(b["train_loss"]), (a, b)


@pytest.mark.slow
def test_losses_equal_stock_lightning_over_20_steps(tmp_path):
    stock, ours = Stock(), Ours()
    _, expected = _fit(stock, tmp_path / "stock", gradient_clip_val=1.0)
    trainer, rows = _fit(ours, tmp_path / "ours")
    assert len(rows) == len(expected) == STEPS and trainer.global_step == STEPS
    for a, b in zip(rows, expected):
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-5 * abs(b["train_loss"]), (a, b)
        assert (a["loss_scale"], a["skipped_steps"]) == (1.0, 0.0)
    for p, q in zip(ours.model.parameters(), stock.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert ours.graph.step_count == STEPS and len(ours.graph.compiled_steps) == 1


@pytest.mark.slow
def test_a_checkpoint_resumes_as_an_uninterrupted_run(tmp_path):
    """Two epochs straight, against one epoch, a checkpoint, and the second epoch resumed in a
    new module and Trainer: graphamp's state rides in Lightning's checkpoint."""
    whole = Ours()
    _, straight = _fit(whole, tmp_path / "straight", epochs=2)
    first = Ours()
    saver = L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    _fit(first, tmp_path / "first", epochs=1, callbacks=[saver])
    checkpoint = torch.load(saver.last_model_path, weights_only=False)
    assert checkpoint[CHECKPOINT_KEY]["step"] == STEPS
    resumed = Ours()
    trainer, rows = _fit(resumed, tmp_path / "resumed", epochs=2, ckpt_path=saver.last_model_path)
    assert trainer.global_step == 2 * STEPS and resumed.graph.step_count == 2 * STEPS
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in straight[STEPS:]]
    for p, q in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(p, q)


@pytest.mark.slow
def test_bf16_mixed_runs_the_step_in_bf16_within_the_project_bounds(tmp_path):
    """Trainer(precision="bf16-mixed") turns on graphamp's bf16 AMP (Lightning's autocast
    around training_step is switched off for graphamp's call); losses within 8% of the stock
    module's under Lightning's own bf16 autocast (tests/test_real_models.py's bound)."""
    stock, ours = Stock(), Ours()
    _, expected = _fit(stock, tmp_path / "stock", gradient_clip_val=1.0, precision="bf16-mixed")
    _, rows = _fit(ours, tmp_path / "ours", precision="bf16-mixed")
    for a, b in zip(rows, expected):
        assert abs(a["train_loss"] - b["train_loss"]) <= 8e-2 * abs(b["train_loss"]), (a, b)
    report = ours.graph.precision_report(with_autocast=False)
    assert ours.graph.config.amp_dtype == torch.bfloat16 and report.ops_low > 0


class Natural(Ours):
    """The pattern Lightning users write: forward on the module, self(x) and self.device in
    the loss, a validation loop that logs."""

    def forward(self, x):
        return self.model(x)

    def training_loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x.to(self.device)), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))


@pytest.mark.slow
def test_lightnings_bookkeeping_between_steps_compiles_nothing_new(tmp_path):
    """Lightning writes attributes on the module between steps (its trainer, the hook it is
    in, logged metrics, the epoch's state), switches to eval and back for validation and crosses
    an epoch: 40 steps, one compiled step. What graphamp captures is training_loss: it reads the
    model's settings and self.device, none of Lightning's bookkeeping."""
    module = Natural()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        val_check_interval=5,
        limit_val_batches=2,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _loader(), _loader())
    assert "val_loss" in trainer.callback_metrics and trainer.global_step == 2 * STEPS
    assert module.graph.step_count == 2 * STEPS
    assert [s.calls for s in module.graph.compiled_steps] == [2 * STEPS]


def test_true_half_precision_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="precision='bf16-true'.*-mixed"):
        _fit(Ours(), tmp_path, precision="bf16-true", max_steps=1)


def test_a_sharding_strategy_graphamp_cannot_run_is_refused_by_name():
    """One device trains alone, DDP on several data parallel (over the world); Lightning's
    FSDP (FSDP1) and DeepSpeed strategies wrap the model and are refused before the first
    step, pointing to the ways that work (tested on strategy objects, without starting
    processes; ModelParallelStrategy is tested on 2 processes)."""
    single = L.Trainer(accelerator="cpu", devices=1, logger=False)
    assert integration._data_parallel(single.strategy) == (False, None)
    ddp = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    assert integration._data_parallel(ddp.strategy) == (True, None)
    with pytest.raises(ConfigError, match="strategy=FSDPStrategy.*ModelParallelStrategy"):
        integration._data_parallel(L.strategies.FSDPStrategy())


def _run_workers(kinds, tmp_path) -> dict:
    """lightning_ddp_worker.py for each kind in turn (Lightning starts its 2 processes), in
    ``tmp_path``; what rank 0 saved, by kind."""
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_ddp_worker.py")
    runs = {}
    for kind in kinds:
        out = tmp_path / f"{kind}.pt"
        done = subprocess.run(
            [sys.executable, worker, kind, str(out)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs[kind] = torch.load(out, weights_only=True)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("ours_kind", ["ours", "ours-zero3", "ours-fsdp2", "ours-mp-unwrapped"])
def test_ddp_on_two_processes_equals_stock_lightning(ours_kind, tmp_path):
    """strategy="ddp", devices=2 on the CPU (gloo), the processes Lightning starts itself: the
    logged losses of rank 0 and the final parameters equal the stock module's. With graphamp's
    ZeRO-3 (configure_graph) too: the parameters stay shards on each rank, Lightning's
    checkpoint holds the whole tensors, and validation runs on the gathered parameters."""
    runs = _run_workers(("stock", ours_kind), tmp_path)
    ours, stock = runs[ours_kind], runs["stock"]
    assert ours["world_size"] == 2 and ours["global_step"] == stock["global_step"] == STEPS // 2
    for a, b in zip(ours["loss"], stock["loss"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (a, b)
    for name, p in stock["params"].items():
        torch.testing.assert_close(ours["params"][name], p, rtol=1e-5, atol=1e-6, msg=name)
    if ours_kind in ("ours-zero3", "ours-fsdp2", "ours-mp-unwrapped"):
        # ZeRO-3's shards; unwrapped under ModelParallelStrategy: data parallel, whole
        assert ours["sharded"] == (ours_kind != "ours-mp-unwrapped")
        (path,) = (tmp_path / "checkpoints").glob("*.ckpt")
        saved = torch.load(path, weights_only=False)["state_dict"]
        for name, p in ours["params"].items():
            assert torch.equal(saved[name], p), name
        model = _model()
        model.load_state_dict({k.removeprefix("model."): v for k, v in saved.items()})
        with torch.no_grad():  # the mean over the validation batches, as Lightning's is
            losses = [F.cross_entropy(model(x), y) for x, y in _loader()]
        expected = torch.stack(losses).mean()
        torch.testing.assert_close(torch.tensor(ours["val_loss"]), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fsdp2_under_model_parallel_strategy_resumes_from_its_distributed_checkpoint(tmp_path):
    """GraphampModule with fully_shard in configure_model under ModelParallelStrategy saves
    Lightning's distributed checkpoint (DCP: each rank's parameter and optimizer shards); a
    run resumed from it after one epoch ends bitwise where two epochs without a stop end."""
    runs = _run_workers(("dcp-first", "dcp-resume", "dcp-full"), tmp_path)
    (saved,) = (tmp_path / "dcp-first" / "checkpoints").glob("*.ckpt")
    assert saved.is_dir() and len(list(saved.glob("*.distcp"))) == 2  # one file per rank
    resumed, full = runs["dcp-resume"], runs["dcp-full"]
    assert resumed["global_step"] == full["global_step"] == 2 * (STEPS // 2)
    assert resumed["loss"] == full["loss"][len(full["loss"]) - len(resumed["loss"]) :]
    for name, p in full["params"].items():
        assert torch.equal(resumed["params"][name], p), name


def test_a_module_without_training_loss_says_what_to_write(tmp_path):
    class Missing(GraphampModule):
        def __init__(self):
            super().__init__()
            self.model = _model()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(CaptureError, match="must define training_loss"):
        _fit(Missing(), tmp_path, max_steps=1)


# -- a switch done halfway says what is missing ----------------------------------------------------


class HalfSwitched(GraphampModule):
    """The base class changed, the stock module's training_step kept."""

    def __init__(self, returns_loss=True):
        super().__init__()
        self.model = _model()
        self.returns_loss = returns_loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss if self.returns_loss else None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_own_training_step_that_skips_graphamp_step_is_refused_at_once(tmp_path):
    module = HalfSwitched()
    with pytest.raises(ConfigError, match="without calling self.graphamp_step.*training_loss"):
        _fit(module, tmp_path, max_steps=5)
    assert module._graphamp_steps == 0


def test_a_whole_epoch_of_skipped_batches_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="whole epoch.*graphamp_step"):
        _fit(HalfSwitched(returns_loss=False), tmp_path, epochs=1)


class Logging(Ours):
    """An own training_step that calls graphamp_step and logs more: a full switch."""

    def training_step(self, batch, batch_idx):
        loss = self.graphamp_step(batch)
        self.log("train_loss", loss)
        self.log("batch_idx", float(batch_idx))
        return loss


def test_an_own_training_step_calling_graphamp_step_trains(tmp_path):
    module = Logging()
    trainer, rows = _fit(module, tmp_path, max_steps=3)
    assert trainer.global_step == 3 and module.graph.step_count == 3
    assert [r["batch_idx"] for r in rows] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    "option, named",
    [
        (
            {"gradient_clip_val": 0.5},
            r"remove Trainer\(gradient_clip_val=0.5\).*clip_grad_max_norm = 0.5",
        ),
        (
            {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"},
            "clipping by value has no graphamp equivalent",
        ),
        (
            {"accumulate_grad_batches": 4},
            r"batches 4 times larger.*set_gradient_accumulation_steps\(4\)",
        ),
    ],
)
def test_lightnings_clipping_and_accumulation_name_graphamps_own(option, named, tmp_path):
    """Refused before anything runs, with graphamp's equivalent (Lightning's own message says
    to go back to automatic optimization)."""
    module = Ours()
    with pytest.raises(ConfigError, match=named):
        _fit(module, tmp_path, max_steps=1, **option)
    assert module.graph is None
