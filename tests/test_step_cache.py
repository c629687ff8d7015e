"""graphamp's step cache (backend/step_cache.py, backend/step_key.py): a second build of the same
step, as after a restart, loads the assembled step instead of assembling it, and trains bitwise
as the assembled one does; anything the step is made from that changed misses; a damaged entry
is ignored with a warning and rebuilt; what the key cannot see is not cached.

Each test has its own empty cache directory (conftest ``_own_step_cache``). The restart in a
fresh process, with inductor, is tests/test_compile_cache.py's.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import threading
import time

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_bitwise, make_graph
from models import TinyGPT, lm_loss, seed_mlp
from torch._subclasses.fake_tensor import FakeTensorMode

import graphamp
from graphamp.backend import cache_directory, step_cache, step_key, step_unpickler, step_values
from graphamp.inspect.memory import step_memory
from graphamp.records.frames import SOURCE_LINE_META
from graphamp.torchkit.cache_root import graphamp_cache_root
from graphamp.torchkit.compat import TORCH_VERSION

# the models here are tiny: outlined as a model whose blocks do enough work is by default
pytestmark = pytest.mark.usefixtures("outline_small_blocks")


def _entries() -> list[str]:
    return sorted(glob.glob(os.path.join(cache_directory.directory(), "*.step")))


def _loaded(g) -> bool:
    timings = g.compiled_steps[-1].timings
    assert "step_cache" in timings, timings
    return "assemble" not in timings


def _mlp_batches(n=3):
    return models.batches(n, 16, 256, 10, seed=1)


def _gpt_batches(n=3):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 64, (4, 16), generator=gen), torch.randint(0, 64, (4, 16), generator=gen))
        for _ in range(n)
    ]


def _train(make, batches, configure=None):
    """A fresh model, optimizer and Graph (seeded the same each time), trained on ``batches``:
    (graph, losses, model state, optimizer state)."""
    torch.manual_seed(0)
    model, loss_fn, opt_factory, kwargs = make()
    opt = opt_factory(model)
    g = make_graph(model, loss_fn, opt, configure=configure, **kwargs)
    losses = [g(x, y).detach().clone() for x, y in batches]
    return g, losses, model.state_dict(), opt.state_dict()["state"]


def _mlp():
    return seed_mlp(), nn.CrossEntropyLoss(), _adamw, {"amp": torch.bfloat16}


def _gpt():
    return TinyGPT(), lm_loss, _adamw, {"amp": torch.bfloat16}


def _gpt_fp16_scaler():
    return TinyGPT(), lm_loss, _sgd, {"amp": torch.float16, "scaler": graphamp.GradScaler()}


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _assert_same(a, b) -> None:
    """Two ``_train`` runs: losses, model state and optimizer state, bitwise."""
    assert_bitwise(a[1:], b[1:])


@pytest.mark.parametrize(
    "make, batches",
    [
        (_mlp, _mlp_batches),
        (_gpt, _gpt_batches),
        pytest.param(_gpt_fp16_scaler, _gpt_batches, marks=pytest.mark.slow),
    ],
    ids=["mlp_bf16_adamw", "tinygpt_bf16_adamw_outlined", "tinygpt_fp16_scaler_sgd"],
)
def test_a_second_build_loads_the_step_and_trains_bitwise_as_the_assembled_one(make, batches):
    data = batches()
    first = _train(make, data)
    assert not _loaded(first[0]) and len(_entries()) == 1
    second = _train(make, data)
    assert _loaded(second[0])
    _assert_same(first, second)
    # and the same as a step that never met the cache
    _assert_same(first, _train(make, data, lambda g: g.config.set_step_cache(False)))
    # what users read of the step is the same: its code, metadata sizes, dumps
    a, b = first[0].compiled_steps[-1], second[0].compiled_steps[-1]
    assert a.step_graph.code == b.step_graph.code
    assert str(step_memory(a.step_graph)) == str(step_memory(b.step_graph))
    assert [n.meta.get("graphamp_subgraph") for n in a.step_graph.graph.nodes] == [
        n.meta.get("graphamp_subgraph") for n in b.step_graph.graph.nodes
    ]


def test_the_step_loads_where_datasets_and_dill_are_imported():
    """``datasets`` brings ``dill``, and torch's GraphPickler then pickles with dill's pickler,
    whose constructors the unpickler's allow-list refuses: no entry ever loaded there. Entries
    are written by the standard pickler whatever is installed (the test extra installs
    ``datasets``, so this runs where users are)."""
    # The compatibility legs install torch without the test extra: there it skips, and the
    # main leg (which installs datasets) runs it.
    pytest.importorskip("datasets")  # imported as a user's script would
    pytest.importorskip("dill")
    import torch.fx._graph_pickler as graph_pickler

    assert graph_pickler.dill is not None  # torch's pickler is dill's here
    data = _mlp_batches()
    first = _train(_mlp, data)
    (path,) = _entries()
    with open(path, "rb") as f:
        assert b"dill" not in f.read()
    second = _train(_mlp, data)
    assert _loaded(second[0])
    _assert_same(first, second)


_WRITTEN: dict = {}  # a global dict build() fills on every call


def _writes_state():
    model = seed_mlp()

    def build(self, x, y):
        out = self.model(x)
        self.model.last = out.detach()  # an attribute of a module, replayed
        loss = nn.functional.cross_entropy(out, y)
        _WRITTEN["loss"] = loss.detach()  # a global's dict entry, replayed
        loss.backward()
        return loss

    return model, None, _adamw, {"amp": torch.bfloat16, "build": build}


def test_a_step_whose_writes_are_replayed_loads_and_replays_them():
    # its replays named the objects that hold the written values (a module, a module's
    # globals), which the key could not hash: such steps were never saved
    first = _train(_writes_state, _mlp_batches())
    assert not _loaded(first[0]) and len(_entries()) == 1
    loss = _WRITTEN.pop("loss")
    second = _train(_writes_state, _mlp_batches())
    assert _loaded(second[0])
    _assert_same(first, second)
    torch.testing.assert_close(_WRITTEN.pop("loss"), loss)  # the loaded step replays it too
    assert isinstance(second[0].model.last, torch.Tensor)


@pytest.mark.parametrize(
    "configure",
    [
        lambda g: g.config.set_outline_blocks(False),
        pytest.param(
            lambda g: g.config.enable_activation_checkpointing(models.Block),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["outlining_off", "activation_checkpointing"],
)
def test_a_step_outlining_did_not_copy_loads_too(configure):
    """A step straight from assembly's trace (outlining off, or recomputed regions) carries the
    tracer class make_fx leaves on it; its entry must load all the same (it once never did,
    and every restart rebuilt it with a warning)."""
    data = _gpt_batches()
    first = _train(_gpt, data, configure)
    assert not _loaded(first[0]) and len(_entries()) == 1
    second = _train(_gpt, data, configure)
    assert _loaded(second[0])
    _assert_same(first, second)


def test_the_loaded_step_runs_with_the_eager_backend_and_outlined_blocks():
    make = lambda: (TinyGPT(), lm_loss, _adamw, {"amp": torch.bfloat16, "backend": "eager"})  # noqa: E731
    data = _gpt_batches()
    first, second = _train(make, data), _train(make, data)
    assert _loaded(second[0])
    assert any(
        n.target is torch.ops.higher_order.invoke_subgraph
        for n in second[0].compiled_steps[-1].step_graph.graph.nodes
    )
    _assert_same(first, second)


def test_the_step_cache_follows_inductors_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("GRAPHAMP_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert cache_directory.directory() == str(tmp_path / "inductor" / "graphamp" / "steps")
    _train(_mlp, _mlp_batches(1))
    assert len(glob.glob(str(tmp_path / "inductor" / "graphamp" / "steps" / "*.step"))) == 1


# -- a change never meets a stale entry ------------------------------------------------------------


_SCRIPT = """
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def build(g, x, y):
    loss = F.cross_entropy(g.model(x), y)
    loss.backward()
    return loss
"""


def _user_script(folder, blank_lines: int):
    """The user's script ``train.py`` in ``folder``, its code ``blank_lines`` lines down."""
    folder.mkdir()
    path = folder / "train.py"
    path.write_text("\n" * blank_lines + _SCRIPT)
    spec = importlib.util.spec_from_file_location("train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _source_lines(gm) -> int:
    graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    return sum(k in n.meta for graph in graphs for n in graph.nodes for k in SOURCE_LINE_META)


def test_a_script_whose_lines_moved_loads_its_step_and_shows_only_its_new_lines(tmp_path):
    """Lines moved by an edit elsewhere in the script (and the script moved to another folder)
    are the same step: the restart loads it, trains bitwise as the first build, and shows the
    script's new lines, never the old ones."""
    runs = []
    for blank_lines in (0, 9):
        script = _user_script(tmp_path / f"checkout{blank_lines}", blank_lines)
        torch.manual_seed(0)
        model = script.Net()
        opt = _adamw(model)
        g = make_graph(model, None, opt, amp=torch.bfloat16, build=script.build)
        batches = models.batches(2, 8, 16, 4, seed=1)
        losses = [g(x, y).detach().clone() for x, y in batches]
        runs.append((g, losses, model.state_dict(), opt.state_dict()["state"]))
    (first, *trained), (moved, *trained_moved) = runs
    assert not _loaded(first) and _loaded(moved)
    assert_bitwise(trained, trained_moved)
    # the precision report reads this build's forward: the new line of each op
    sources = {row["source"] for row in moved.precision_report().rows if row["source"]}
    assert sources and all(s.startswith("train.py:") for s in sources), sources
    old = {row["source"] for row in first.precision_report().rows if row["source"]}
    assert {int(s.split(":")[1]) for s in sources} == {int(s.split(":")[1]) + 9 for s in old}
    # the steps keep no source lines (a loaded one could only show stale ones): the assembled
    # and the loaded step are one code, as AOTAutograd's cache key reads it
    steps = [g.compiled_steps[-1].step_graph for g in (first, moved)]
    assert [_source_lines(step) for step in steps] == [0, 0]
    assert steps[0].code == steps[1].code and "checkout" not in steps[1].code


def _versioned_mlp(variant: str):
    """The same class name and structure, its forward edited between two "runs"."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(256, 64), nn.Linear(64, 10)

        def forward(self, x):
            h = self.fc1(x)
            h = F.gelu(h) if variant == "gelu" else F.relu(h)
            return self.fc2(h)

    return lambda: (Net(), nn.CrossEntropyLoss(), _adamw, {"amp": torch.bfloat16})


def _relu_with(kwargs=None, opt_factory=None):
    def make():
        model, loss_fn, default_opt, default_kwargs = _versioned_mlp("relu")()
        return model, loss_fn, opt_factory or default_opt, {**default_kwargs, **(kwargs or {})}

    return make


# (model maker, Graph configuration) of a step that differs from the base in one thing
CHANGES = {
    "forward code": (_versioned_mlp("gelu"), None),
    "amp dtype": (_relu_with({"amp": torch.float16}), None),
    "fp32 pin": (_relu_with(), lambda g: g.config.pin_fp32("model.fc2")),
    "precision list": (_relu_with(), lambda g: g.config.override_amp_lists(deny=["addmm"])),
    "optimizer option": (
        _relu_with(opt_factory=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, amsgrad=True)),
        None,
    ),
    "clipping": (_relu_with({"clip": 1.0}), None),
    "outlining off": (_relu_with(), lambda g: g.config.set_outline_blocks(False)),
    "torch build": (_relu_with(), None),
    "graphamp source": (_relu_with(), None),
}


@pytest.mark.filterwarnings("ignore:.*fp16 AMP without a grad scaler")
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_model_config_pin_optimizer_or_version_never_loads_a_stale_step(
    change, monkeypatch
):
    """After the base step is cached, each change misses (a new entry), and the changed step
    computes bitwise what it computes on an empty cache."""
    data = _mlp_batches()
    base = _train(_versioned_mlp("relu"), data)
    assert len(_entries()) == 1
    if change == "torch build":
        monkeypatch.setattr(torch.version, "git_version", "another torch build")
    if change == "graphamp source":
        monkeypatch.setattr(step_key, "graphamp_source", lambda: "an edited graphamp")
    make, configure = CHANGES[change]
    changed = _train(make, data, configure)
    assert not _loaded(changed[0]), change
    assert len(_entries()) == 2, change
    monkeypatch.setenv(
        "GRAPHAMP_CACHE_DIR", os.path.join(cache_directory.directory(), "..", "fresh")
    )
    fresh = _train(make, data, configure)
    assert not _loaded(fresh[0])
    _assert_same(changed, fresh)
    if change not in ("torch build", "graphamp source", "outlining off"):
        assert not torch.equal(changed[1][-1], base[1][-1]), change  # a stale hit would show


def test_a_new_learning_rate_or_parameter_values_still_load_the_step():
    """Hyperparameters and parameter values are inputs of the step, not part of it."""
    data = _mlp_batches()
    base = _train(_relu_with(), data)
    assert not _loaded(base[0])
    faster = _train(
        _relu_with(opt_factory=lambda m: torch.optim.AdamW(m.parameters(), lr=0.1)), data
    )
    assert _loaded(faster[0])
    assert not torch.equal(faster[1][-1], base[1][-1])  # the new lr is used
    torch.manual_seed(123)  # other initial values
    model, loss_fn, _, kwargs = _relu_with()()
    g = make_graph(model, loss_fn, _adamw(model), **kwargs)
    g(*data[0])
    assert _loaded(g)
    assert len(_entries()) == 1


# -- damage, concurrency ---------------------------------------------------------------------------


def _damage(path: str, how: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    if how == "directory":
        os.remove(path)
        os.makedirs(path)
        return
    damaged = {
        "truncated": data[: len(data) // 2],
        "emptied": b"",
        "flipped byte": data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:],
        "garbage": b"\x00damaged\xff" * 1000,
        "other format": b"graphamp-step-cache 0\n" + data[22:],
    }[how]
    with open(path, "wb") as f:
        f.write(damaged)


@pytest.mark.parametrize(
    "how", ["truncated", "emptied", "flipped byte", "garbage", "other format", "directory"]
)
def test_a_damaged_entry_is_ignored_with_a_warning_and_rebuilt(how, caplog):
    data = _mlp_batches()
    first = _train(_mlp, data)
    (path,) = _entries()
    _damage(path, how)
    with caplog.at_level(logging.WARNING, logger="graphamp"):
        second = _train(_mlp, data)
    warnings = [r.getMessage() for r in caplog.records if "step cache: ignoring" in r.getMessage()]
    assert len(warnings) == 1 and path in warnings[0], caplog.text
    assert not _loaded(second[0])
    _assert_same(first, second)
    if how != "directory":  # rebuilt: written again, whole, and the next build loads it
        third = _train(_mlp, data)
        assert _loaded(third[0])
        _assert_same(first, third)


def test_concurrent_writers_of_one_entry_leave_one_whole_entry():
    """Eight writers of one entry at once (as eight processes would: each its own step) leave
    one whole entry and no temporary file; it loads with every traced value."""
    _train(_mlp, _mlp_batches(1))
    (path,) = _entries()
    key = os.path.basename(path)[: -len(".step")]
    steps = [step_cache.load("G", key, FakeTensorMode()) for _ in range(8)]
    values = sum("val" in n.meta for n in steps[0].step_gm.graph.nodes)
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda s=s: results.append(step_cache.save("G", key, s)))
        for s in steps
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 8
    assert os.listdir(cache_directory.directory()) == [os.path.basename(path)]
    again = step_cache.load("G", key, FakeTensorMode())
    assert again is not None and again.step_gm.code == steps[0].step_gm.code
    assert sum("val" in n.meta for n in again.step_gm.graph.nodes) == values > 0


# -- trust (issue 36) -----------------------------------------------------------------------------


class _Planted:
    """What a planted pickle does when unpickled: sets a flag (a real attack runs anything)."""

    def __reduce__(self):
        return (exec, ("import builtins; builtins.graphamp_planted_code_ran = True",))


def _old_style_entry(payload: bytes) -> bytes:
    """An entry framed as the step cache framed them before: a digest anyone can recompute."""
    import hashlib

    return b"graphamp-step-cache 2\n" + hashlib.sha256(payload).digest() + payload


@pytest.mark.parametrize("how", ["planted pickle", "edited step"])
def test_a_forged_entry_runs_no_code_and_is_not_used(how, caplog):
    """A file written into the directory with its digest recomputed: the planted pickle is
    never unpickled, the edited step (its float constants multiplied) never trains."""
    import builtins
    import pickle

    data = _mlp_batches()
    first = _train(_mlp, data)
    (path,) = _entries()
    key = os.path.basename(path)[: -len(".step")]
    if how == "planted pickle":
        payload = pickle.dumps(_Planted())
    else:
        step = step_cache.load("G", key, FakeTensorMode())
        edited = 0
        for node in step.step_gm.graph.nodes:  # every float constant of the step times ten
            if any(type(a) is float for a in node.args):
                node.args = tuple(a * 10 if type(a) is float else a for a in node.args)
                edited += 1
        assert edited > 0
        step.step_gm.recompile()
        payload = step_unpickler.dumps(step)
    with open(path, "wb") as f:
        f.write(_old_style_entry(payload))
    with caplog.at_level(logging.WARNING, logger="graphamp"):
        second = _train(_mlp, data)
    assert not hasattr(builtins, "graphamp_planted_code_ran")
    assert "it is not authenticated" in caplog.text and "was not unpickled" in caplog.text
    assert not _loaded(second[0])
    _assert_same(first, second)


def test_even_an_authenticated_entry_builds_only_what_a_step_holds(caplog):
    """The second wall: a planted pickle authenticated with the user's own secret (as a
    graphamp that pickled too much would write it) is refused by the unpickler."""
    import builtins
    import pickle

    data = _mlp_batches()
    first = _train(_mlp, data)
    (path,) = _entries()
    key = os.path.basename(path)[: -len(".step")]
    with open(os.path.join(graphamp_cache_root(), "secret"), "rb") as f:
        secret = f.read()
    payload = pickle.dumps(_Planted())
    with open(path, "wb") as f:
        f.write(b"graphamp-step-cache 2\n" + cache_directory._mac(secret, key, payload) + payload)
    with caplog.at_level(logging.WARNING, logger="graphamp"):
        second = _train(_mlp, data)
    assert not hasattr(builtins, "graphamp_planted_code_ran")
    assert "may not build builtins.exec" in caplog.text, caplog.text
    assert not _loaded(second[0])
    _assert_same(first, second)


@pytest.mark.slow
def test_an_entry_copied_over_another_keys_entry_is_refused(caplog):
    mlp_data, gpt_data = _mlp_batches(), _gpt_batches()
    _train(_mlp, mlp_data)
    (mlp_entry,) = _entries()
    cold = _train(_gpt, gpt_data)
    (gpt_entry,) = [e for e in _entries() if e != mlp_entry]
    with open(mlp_entry, "rb") as src, open(gpt_entry, "wb") as dst:
        dst.write(src.read())  # a valid entry, of another step
    with caplog.at_level(logging.WARNING, logger="graphamp"):
        again = _train(_gpt, gpt_data)
    assert "it is not authenticated" in caplog.text
    assert not _loaded(again[0])
    _assert_same(cold, again)


def _symlinked(root):
    real = root.parent / (root.name + "-real")
    real.mkdir(mode=0o700)
    root.rmdir()
    root.symlink_to(real)


def _world_writable(root):
    root.chmod(0o777)


def _foreign(root):
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    os.chown(root, 65534, 65534)


@pytest.mark.parametrize("make_unsafe", [_symlinked, _world_writable, _foreign])
def test_a_directory_that_is_not_the_users_own_turns_the_cache_off(make_unsafe, caplog, tmp_path):
    """Another local user pre-creates the directory (world-writable, or as a symbolic link to
    one of hers, or owned by her): graphamp neither writes there nor reads from there."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    os.environ["GRAPHAMP_CACHE_DIR"] = str(root)  # conftest's monkeypatch restores it
    make_unsafe(root)
    data = _mlp_batches()
    with caplog.at_level(logging.WARNING, logger="graphamp"):
        first = _train(_mlp, data)
        second = _train(_mlp, data)
    assert "step cache: off for this process" in caplog.text
    assert not _loaded(second[0])
    assert not os.path.exists(os.path.join(root, "steps")) or not os.listdir(
        os.path.join(root, "steps")
    )
    _assert_same(first, second)


def test_stale_temporary_files_are_removed_and_fresh_ones_kept():
    _train(_mlp, _mlp_batches(1))
    folder = cache_directory.directory()
    stale, fresh = os.path.join(folder, ".tmp-old.step"), os.path.join(folder, ".tmp-new.step")
    for path in (stale, fresh):
        with open(path, "wb") as f:
            f.write(b"half")
    os.utime(stale, (0, 0))
    cache_directory._opened.clear()  # as a new process opens the directory
    _train(_mlp, _mlp_batches(1))
    assert not os.path.exists(stale) and os.path.exists(fresh)


def _age(path: str, days: float) -> None:
    """Make ``path`` look last used ``days`` ago."""
    then = time.time() - days * 86400
    os.utime(path, (then, then))


def test_entries_unused_for_30_days_are_removed_and_used_ones_kept(caplog):
    g, *_ = _train(_mlp, _mlp_batches(1))
    folder = cache_directory.directory()
    (used,) = _entries()
    other = [os.path.join(folder, "0" * 64 + ".step"), os.path.join(folder, "0" * 64 + ".aot")]
    for path in other:  # another graphamp's or another model's: never read again
        with open(path, "wb") as f:
            f.write(b"x" * 1000)
    young = os.path.join(folder, "1" * 64 + ".step")
    with open(young, "wb") as f:
        f.write(b"y")
    for path in [used, *other]:
        _age(path, 31)
    _age(young, 29)
    cache_directory._opened.clear()  # as a new process opens the directory
    with caplog.at_level(logging.INFO, logger="graphamp"):
        g2, *_ = _train(_mlp, _mlp_batches(1))
    # the old entry this build reads was removed first, so the step is assembled again
    assert not _loaded(g2)
    assert not any(os.path.exists(p) for p in other)
    assert os.path.exists(young) and os.path.exists(used)  # saved again
    assert "removed 3 entries and notes not used for 30 days" in caplog.text


def test_reading_an_entry_marks_it_used(monkeypatch):
    _train(_mlp, _mlp_batches(1))
    (entry,) = _entries()
    _age(entry, 20)
    g, *_ = _train(_mlp, _mlp_batches(1))
    assert _loaded(g)
    assert time.time() - os.path.getmtime(entry) < 3600  # read now: kept 30 more days
    # GRAPHAMP_CACHE_DAYS shortens the wait: 10 days unused is now too long
    _age(entry, 11)
    monkeypatch.setenv("GRAPHAMP_CACHE_DAYS", "10")
    cache_directory._opened.clear()
    g, *_ = _train(_mlp, _mlp_batches(1))
    assert not _loaded(g)


@pytest.mark.parametrize("text", ["soon", "0", "-3", "nan"])
def test_a_bad_number_of_days_warns_and_keeps_the_default(monkeypatch, caplog, text):
    monkeypatch.setenv("GRAPHAMP_CACHE_DAYS", text)
    with caplog.at_level(logging.WARNING, logger="graphamp"):
        assert cache_directory._unused_days() == 30
    assert "not a positive number of days" in caplog.text


# -- not cached --------------------------------------------------------------------------------------


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _MyScaler(graphamp.GradScaler):
    pass


@torch.library.custom_op("graphamp_test::cube", mutates_args=())
def _cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


@_cube.register_fake
def _(x):
    return torch.empty_like(x)


def _cube_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return 3 * x * x * grad


_cube.register_autograd(
    _cube_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0])
)


def _custom_op_step(g, x, y):
    loss = F.cross_entropy(_cube(g.model(x)), y)
    loss.backward()
    return loss


def _function_step(g, x, y):
    loss = F.cross_entropy(_Square.apply(g.model(x)), y)
    loss.backward()
    return loss


@pytest.mark.parametrize(
    "what, kwargs, configure, reason",
    [
        ("custom Function", {"build": _function_step}, None, "custom autograd Function"),
        ("custom op", {"build": _custom_op_step}, None, "custom op graphamp_test.cube"),
        (
            "scaler subclass",
            {"amp": torch.float16, "scaler": _MyScaler()},
            None,
            "GradScaler subclass",
        ),
        ("switched off", {}, lambda g: g.config.set_step_cache(False), None),
    ],
)
def test_what_the_key_cannot_see_is_not_cached(what, kwargs, configure, reason, caplog):
    torch.manual_seed(0)
    model = seed_mlp()
    g = make_graph(model, nn.CrossEntropyLoss(), _adamw(model), configure=configure, **kwargs)
    with caplog.at_level(logging.INFO, logger="graphamp"):
        g(*_mlp_batches(1)[0])
    assert _entries() == []
    if reason is None:
        assert "step_cache" not in g.compiled_steps[-1].timings
    else:
        assert "step_cache" in caplog.text and reason in caplog.text, caplog.text


def _variable_lengths(n=5):
    """Language-model batches whose sequence length changes: the second length makes the
    step's sizes symbolic."""
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 64, (4, t), generator=gen), torch.randint(0, 64, (4, t), generator=gen))
        for t in (8, 12, 16, 10, 14)[:n]
    ]


@pytest.mark.slow  # moved from the default lane to keep it near 10 minutes (--durations)
def test_a_step_with_symbolic_sizes_is_cached_with_its_guards(monkeypatch):
    """The automatic dynamic step (sizes as symbols after a length changed) is saved; a second
    build loads it (no assembly), assumes the same size guards and trains bitwise like it."""
    data = _variable_lengths()
    first = _train(_gpt, data)
    if TORCH_VERSION < (2, 13):  # torch 2.11 pins the length in capture: a step per length
        assert any(p.guards.shapes.pinned for p in first[0]._programs.values())
        assert len(first[0].compiled_steps) == len(data) == len(_entries())
        second = _train(_gpt, data)
        assert all("assemble" not in s.timings for s in second[0].compiled_steps)
        _assert_same(first, second)
        return
    assert len(first[0].compiled_steps) == 2 and len(_entries()) == 2  # static, then dynamic
    assumed = []
    assume = step_values.assume
    monkeypatch.setattr(step_values, "assume", lambda g, m: assumed.append(len(g)) or assume(g, m))
    second = _train(_gpt, data)
    assert assumed[-1] > 0  # the dynamic entry's guards were replayed into the build
    assert _loaded(second[0])
    assert all("assemble" not in s.timings for s in second[0].compiled_steps)
    _assert_same(first, second)
    a, b = (g._programs.last() for g in (first[0], second[0]))
    assert a.guards.shapes.dynamic and a.guards.shapes.dynamic == b.guards.shapes.dynamic
    assert a.guards.shapes.expression == b.guards.shapes.expression
    assert a.step_gm.code == b.step_gm.code


def test_a_dynamic_step_with_data_dependent_sizes_is_not_saved(caplog):
    """A boolean mask's size has no name a later trace would give it: with symbolic batch
    sizes beside it the step is trained, not saved (with static batch sizes it is saved:
    tests/test_compile_cache.py's masked case)."""

    def masked(g, x, y):
        keep = y >= 0
        loss = F.cross_entropy(g.model(x)[keep], y[keep])
        loss.backward()
        return loss

    torch.manual_seed(0)
    model = seed_mlp()
    g = make_graph(model, nn.CrossEntropyLoss(), _adamw(model), build=masked)
    with caplog.at_level(logging.INFO, logger="graphamp"):
        for n in (16, 24, 32):
            g(torch.randn(n, 256), torch.randint(0, 10, (n,)))
    assert "not saved (symbolic sizes and data-dependent ones)" in caplog.text
    assert len(g.compiled_steps) == 2 and len(_entries()) == 1  # the static step only


def test_an_entry_whose_size_guards_fail_for_this_batch_is_not_used():
    """An entry's guards are checked against the sizes of the build that loads it before
    anything is assumed (a guard assembly made for other sizes would be wrong here)."""
    import sympy
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    size = env.create_unspecified_symint_and_symbol(8, ConstantSource("n"), DimDynamic.DYNAMIC)
    mode = FakeTensorMode(shape_env=env)
    symbol = size.node.expr
    assert step_values.guards_hold([sympy.Ge(symbol, 4)], mode)
    assert not step_values.guards_hold([sympy.Ge(symbol, 4), sympy.Ge(symbol, 10)], mode)
    before = list(env.guards)
    step_values.assume([sympy.Ge(symbol, 4)], mode)
    assert len(env.guards) == len(before) + 1


def test_a_step_with_overflow_tracing_loads_too():
    """Its probes were once selected with an index list, a tensor constant of the step that the
    unpickler refuses: every restart assembled again."""
    data = _gpt_batches()

    def trace(g):
        g.config.enable_overflow_tracing()

    first = _train(_gpt_fp16_scaler, data, trace)
    second = _train(_gpt_fp16_scaler, data, trace)
    assert not _loaded(first[0]) and _loaded(second[0])
    _assert_same(first, second)


def test_an_entry_never_holds_a_real_tensor():
    """A real tensor's pickle rebuilds its storage through torch.load, which the unpickler
    refuses: an entry holding one would never load, so the pickler refuses it and the step is
    not saved (``save`` logs why). Capture lifts build()'s constants into step inputs; the
    step's own code must make none (the overflow probes once did, above)."""
    import pickle

    with pytest.raises(pickle.PicklingError, match="holds a tensor constant"):
        step_unpickler.dumps({"index": torch.tensor([0, 2])})
    assert step_unpickler.dumps({"n": 3})  # what is no tensor pickles as before


def test_an_entry_holding_symbolic_sizes_loads():
    """A dynamic step's sizes are sympy expressions over torch's own functions and numbers: a
    mean over a symbolic length divides by ``ToFloat(s0*4)``, a view's size may be a
    ``FloorDiv``, a symbol's range ends at ``int_oo``. The unpickler builds them (it refused
    ``ToFloat`` once, so no dynamic step with a mean loss ever loaded from the cache)."""
    import pickle

    import sympy
    from torch.utils._sympy.functions import FloorDiv, ToFloat
    from torch.utils._sympy.numbers import int_oo

    s0 = sympy.Symbol("s0", integer=True, positive=True)
    for size in (2.5 * ToFloat(4 * s0), FloorDiv(s0, 4), int_oo):
        assert step_unpickler.loads(step_unpickler.dumps(size), FakeTensorMode()) == size
    # the list stays a list: a module beside them that builds no size is still refused
    payload = pickle.dumps(pickle.loads)
    with pytest.raises(pickle.UnpicklingError, match="may not build"):
        step_unpickler.loads(payload, FakeTensorMode())


@pytest.mark.unloadable_step
def test_a_step_the_loader_would_refuse_is_refused_when_saved(monkeypatch, caplog):
    """The pickler checks every class and function it writes by name against the unpickler's
    list, so an entry that could never load is never written: the save says which name (a
    WARNING: the two halves of one list disagreeing is graphamp's bug), not each restart."""
    import sympy
    from torch.utils._sympy.functions import ToFloat

    size = 2.5 * ToFloat(4 * sympy.Symbol("s0", integer=True, positive=True))
    refused = step_unpickler._CLASS_MODULES - {"torch.utils._sympy.functions"}
    monkeypatch.setattr(step_unpickler, "_CLASS_MODULES", refused)
    with pytest.raises(step_unpickler.UnloadableGlobal, match="utils._sympy.functions.ToFloat"):
        step_unpickler.dumps({"size": size})
    # a step whose graph holds it is not saved, with the name in a warning
    monkeypatch.setattr(
        step_unpickler, "dumps", lambda obj: step_unpickler._check_loadable(ToFloat)
    )
    torch.manual_seed(0)
    model = seed_mlp()
    g = make_graph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    with caplog.at_level(logging.INFO, logger="graphamp"):
        g(torch.randn(8, 256), torch.randint(0, 10, (8,)))
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "ToFloat" in r.message]
    assert warned and "not saved" in warned[0].message, caplog.text
