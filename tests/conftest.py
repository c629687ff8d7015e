import logging
import os
import signal
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed_and_quiet():
    torch.manual_seed(0)
    yield
    logging.getLogger("graphamp").handlers.clear()


@pytest.fixture(autouse=True)
def _own_step_cache(tmp_path_factory, monkeypatch):
    """Each test starts with an empty step cache (backend/step_cache.py): what a test builds
    never depends on which tests ran before it. A test that builds the same step twice loads it
    the second time, as a restart would."""
    monkeypatch.setenv("GRAPHAMP_CACHE_DIR", str(tmp_path_factory.mktemp("graphamp-cache")))


class _Unloadable(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        if hasattr(record, "unloadable_global"):  # step_cache.save's refusal
            self.messages.append(record.getMessage())


@pytest.fixture(autouse=True)
def _every_saved_step_loads(request):
    """Every step any test saves could be loaded by the step cache's unpickler: its pickler
    refuses, with a warning, a class or function the loader's list leaves out
    (``backend/step_unpickler.py``), and here that fails the test. So each model the suite
    builds (dynamic, fp8, ZeRO, recomputed, outlined steps) checks the list, not only the
    tests that restart, and a gap cannot stay silent (a dynamic step's ``ToFloat`` did)."""
    handler = _Unloadable()
    log = logging.getLogger("graphamp")
    log.addHandler(handler)
    yield
    log.removeHandler(handler)
    if request.node.get_closest_marker("unloadable_step") is None:
        assert not handler.messages, "\n".join(handler.messages)


@pytest.fixture(autouse=True)
def _products_by_the_lists(request, monkeypatch):
    """Matrix products and convolutions in the precision the lists give them, untimed
    (``passes/dense_ops.py``), except in tests marked ``timed_products``: the suite's other
    tests assert the lists' decisions, and timing would make them the machine's (a CPU without
    bf16 instructions keeps every product fp32). In-process builds only: a child process times
    as users' do."""
    if request.node.get_closest_marker("timed_products") is None:
        from graphamp.passes import dense_ops

        monkeypatch.setattr(dense_ops, "MIN_MACS", float("inf"))


@pytest.fixture
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt in this test, as in an interactive shell, whatever the
    parent set: ``nohup`` and ``&`` start pytest with SIGINT ignored, which graphamp's handler
    then honours (it passes a held-back interrupt to the handler it replaced). graphamp's
    handler is installed again in front of Python's default one, and both are put back after."""
    from graphamp.runtime import interrupts

    deferral = interrupts._deferral  # the process's one SIGINT deferral
    saved = (signal.getsignal(signal.SIGINT), deferral.installed, deferral.previous)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    deferral.installed, deferral.previous = False, None  # the next step installs it again
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved[0])
        deferral.installed, deferral.previous = saved[1], saved[2]


# GRAPHAMP_TESTS_STOP_AT (a Unix time): tests not started by then are skipped with a reason
# that says so. .ci/run sets it for its slow lane so that the run ends, and says how many it
# left, inside CI's time limit; nothing else sets it.
_STOP_AT = float(os.environ.get("GRAPHAMP_TESTS_STOP_AT") or "inf")
TIME_BUDGET_SKIP = "not run: the time budget GRAPHAMP_TESTS_STOP_AT was spent before it started"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if time.time() > _STOP_AT:
        pytest.skip(TIME_BUDGET_SKIP)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def outline_small_blocks(monkeypatch):
    """The CPU's default outlines repeated blocks only where the step does enough work per
    block for outlining to cost it under 2% (step/block_work.py); the tests' models are tiny.
    Tests of the outlined default's machinery take it as a model with large blocks does."""
    import graphamp.step.block_work as block_work

    monkeypatch.setattr(block_work, "OUTLINE_MIN_FLOPS_PER_BLOCK", 0.0)
    monkeypatch.setattr(block_work, "BLOCK_UPDATE_MIN_FLOPS_PER_BLOCK", 0.0)
