"""The blocks' update kernels compiled in a process beside the step's compile (issue 40).

A cold compile of a step with block updates (``step/block_update.py``, the CPU's default for
blocks repeated 3 times) makes two programs that do not depend on each other: the step, which
calls ``graphamp::update_block_`` as an opaque op, and each distinct block's update kernel. In
one process they ran one after the other, and the kernel took 3.4 s of the 6-layer GPT-2's
25.7 s first call (2-core CPU), nearly all of it Python (AOTAutograd's trace, inductor's
lowering and code generation) on one core while the other waited.

So, where the kernels are noted (the step cache is on) and not made yet, a child Python process
compiles them with inductor while this one compiles the step. It is given the kernels' specs and
this process's compile settings (``context_state``), and writes what a restart would read:
inductor's and AOTAutograd's cache entries, and each kernel's note
(``noted_step.compile_kernel``) in the same directories. After the step's compile, this process
waits for the child and makes the kernels as a restart does, from the notes. What the child
made is used only where it is what this process would have made, which the note's check decides
as on any restart (the compile's context, keyed by AOTAutograd). Where the child failed, was
stopped, or compiled in another context, this process compiles the kernel itself, as before.
The child costs about 4 s of CPU to import torch, which the second core had spare.

Only kernels of CPU tensors are compiled beside (a child would otherwise start its own CUDA
context), only with two or more cores for this process and no process group (ranks share the
machine's cores already), and never when ``GRAPHAMP_SIDE_COMPILE=0``.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._functorch, torch._inductor
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
from functools import partial

import torch

from ..backend import compile_step, noted_step, step_cache, step_values
from ..backend.aot_key import read_note, remembered_key
from ..backend.step_key import step_key
from ..step import (
    block_devices,
    block_example,
    block_specs,
    compile_block_kernels,
    set_kernel_backend,
    unmade_specs,
)
from ..torchkit.cache_root import graphamp_cache_root, inductor_cache_directory
from ..torchkit.frame_stack import on_roomy_stack
from ..torchkit.shapes import fake_batch, new_fake_mode

log = logging.getLogger("graphamp")

WAIT_S = 600.0  # the longest this process waits for the child before compiling itself


def compile_noted_kernel(graph_name: str, spec: str, trace, example: list, cached: bool):
    """A block kernel compiled with AOTAutograd's key noted under a key of its own;
    ``cached``: made from its note where there is one (``noted_step.compile_kernel``)."""
    key = _note_key(spec, [t.stride() for t in example])
    return noted_step.compile_kernel(graph_name, key, trace, example, cached)


def _note_key(spec: str, strides: list) -> str:
    """The kernel's own key: its spec, its inputs' strides, torch's and graphamp's versions."""
    return step_key(("update_block_", spec, strides))


def _noted(graph_name: str, spec: str) -> bool:
    """Whether the kernel of ``spec`` (for contiguous tensors) has a note to be made from."""
    strides = [t.stride() for t in block_example(spec)]
    return noted_step.usable(read_note(graph_name, _note_key(spec, strides)))


class SideCompile:
    """A child process for the blocks' kernels, started before assembly so that its import of
    torch runs while this process assembles the step (one core busy); the kernels are asked
    for at compile time (``request``), and ``finished()`` says whether it made them."""

    def __init__(self, proc: subprocess.Popen, errors) -> None:
        self._proc = proc
        self._errors = errors  # the child's stderr, kept for the debug log of a failure
        self._started = time.perf_counter()

    @classmethod
    def spawn(cls, graph_name: str) -> SideCompile | None:
        """The child, importing what a compile needs and then waiting for its request; None
        where the side compile does not apply."""
        if not applies():
            return None
        errors = tempfile.TemporaryFile()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=errors,
                env=_child_env(),
            )
        except OSError as e:  # no interpreter to start, no processes left: compiled here
            errors.close()
            log.debug("%s: the block kernels are compiled in this process: %s", graph_name, e)
            return None
        return cls(proc, errors)

    def request(self, graph_name: str, specs: list[str]) -> bool:
        """Ask the child for the kernels of ``specs`` this process has neither made nor noted;
        False (the child told to stop) where there are none, or it was asked or stopped
        already (a second try of the step's compile makes its kernels here), or it is gone."""
        stdin = self._proc.stdin
        if stdin is None or stdin.closed:
            self.stop()
            return False
        todo = [
            s
            for s in unmade_specs(specs)
            if block_devices(s) == {"cpu"} and not _noted(graph_name, s)
        ]
        if not todo:
            self.stop()
            return False
        request = pickle.dumps({"graph": graph_name, "specs": todo, "context": context_state()})
        try:
            stdin.write(request)
            stdin.close()
        except OSError as e:  # the child is gone: compiled here
            self.stop()
            log.debug("%s: the side compile could not start: %s", graph_name, e)
            return False
        log.debug("%s: compiling %d block kernel(s) beside the step", graph_name, len(todo))
        return True

    def request_step(self, request: dict) -> bool:
        """Ask the child to compile a step saved in the step cache (``tier_up.py``); False
        (the child stopped) where it is gone or the request does not pickle."""
        stdin = self._proc.stdin
        if stdin is None or stdin.closed:
            self.stop()
            return False
        try:
            data = pickle.dumps({"step": request})
            stdin.write(data)
            stdin.close()
        except Exception as e:  # an option that does not pickle, the child gone: not beside
            self.stop()
            log.debug("%s: the step could not be compiled beside: %s", request["graph"], e)
            return False
        return True

    def running(self) -> bool:
        return self._proc.poll() is None

    def finished(self, graph_name: str) -> bool:
        """Wait for the child (at most ``WAIT_S`` from its start); whether it compiled every
        kernel it was asked for."""
        try:
            code = self._proc.wait(timeout=max(0.0, WAIT_S - self.seconds()))
        except subprocess.TimeoutExpired:
            self.stop()
            log.debug("%s: the side compile took over %.0f s; stopped", graph_name, WAIT_S)
            return False
        except BaseException:  # interrupted while waiting: the child goes too
            self.stop()
            raise
        if code != 0:
            self._errors.seek(0)
            tail = self._errors.read()[-2000:].decode(errors="replace")
            log.debug("%s: the side compile failed (exit code %s):\n%s", graph_name, code, tail)
        self._errors.close()
        return code == 0

    def seconds(self) -> float:
        return time.perf_counter() - self._started

    def stop(self) -> None:
        """Stop the child (nothing to compile, this process's build failed, or it waited long
        enough): its input closed, and the process killed if it still runs."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._errors.close()


def applies() -> bool:
    """Whether a child process may compile beside this one."""
    if os.environ.get("GRAPHAMP_SIDE_COMPILE", "1") == "0":
        return False
    if getattr(sys, "frozen", False) or not sys.executable:  # no Python to start
        return False
    return _cores() >= 2  # on one core the child would only take turns with the step's compile


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def context_state() -> dict:
    """This process's settings that AOTAutograd's and inductor's keys read (the compile's
    context), for the child to take: a kernel compiled in another context is not used."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    matmul = torch.backends.cuda.matmul
    state: dict = {
        "threads": torch.get_num_threads(),
        "default_dtype": torch.get_default_dtype(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul": (
            getattr(matmul, "fp32_precision", None),  # torch 2.9+; read by inductor's key
            matmul.allow_fp16_reduced_precision_reduction,
            matmul.allow_bf16_reduced_precision_reduction,
        ),
    }
    for name, config in (("inductor", inductor_config), ("functorch", functorch_config)):
        try:
            state[name] = config.save_config()
        except Exception:  # a setting that does not pickle (a user's pass): the child's own
            pass
    return state


def _take_context(state: dict) -> None:
    """The child: this process's settings made the parent's (``context_state``)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch.set_num_threads(state["threads"])
    torch.set_default_dtype(state["default_dtype"])
    enabled, warn_only = state["deterministic"]
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    # setting the precision sets cuda's fp32_precision too ("highest": "ieee", where an
    # untouched process has "none"), so only where it differs, and that one after it
    if torch.get_float32_matmul_precision() != state["float32_matmul_precision"]:
        torch.set_float32_matmul_precision(state["float32_matmul_precision"])
    matmul = torch.backends.cuda.matmul
    fp32, fp16, bf16 = state["cuda_matmul"]
    if fp32 is not None and matmul.fp32_precision != fp32:
        matmul.fp32_precision = fp32
    matmul.allow_fp16_reduced_precision_reduction = fp16
    matmul.allow_bf16_reduced_precision_reduction = bf16
    for name, config in (("inductor", inductor_config), ("functorch", functorch_config)):
        if name in state:
            config.load_config(state[name])
    inductor_config.compile_threads = 1  # one kernel: no pool (not part of any key)


def _child_env() -> dict[str, str]:
    """This process's environment, with the cache directories as this process resolves them,
    this process's import path (the same graphamp and torch), and one compile thread: the
    child compiles one kernel and needs no pool of compile processes."""
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_directory()
    env["GRAPHAMP_CACHE_DIR"] = graphamp_cache_root()
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    env["TORCH_WARM_POOL"] = "0"
    return env


_CHILD = f"import sys; from {__name__} import child_main; sys.exit(child_main())"


def child_main() -> int:
    """The child: import what a compile needs, then compile the kernels of the request on
    stdin, noting each (no request: nothing to do)."""
    return on_roomy_stack(_child_work)


def _child_work() -> int:
    import torch._inductor.compile_fx  # noqa: F401 - imported while the parent assembles

    data = sys.stdin.buffer.read()
    if not data:
        return 0
    request = pickle.loads(data)  # from the parent process, over a pipe
    if "step" in request:  # the steady step, compiled while the parent trains (tier_up.py)
        _take_context(request["step"]["context"])
        return compile_saved_step(request["step"])
    _take_context(request["context"])
    compiler = partial(compile_noted_kernel, request["graph"])
    compile_block_kernels(request["specs"], False, compiler)
    return 0


def compile_saved_step(request: dict) -> int:
    """The child: the step saved under the request's key compiled as this process's parent
    would (its inductor entries and its note written), and its blocks' kernels; 1 where the
    step cache does not hold it."""
    name, key = request["graph"], request["key"]
    mode = new_fake_mode()
    # the batch's symbols first, made as the parent's build made them: the same names
    stand_ins = [
        torch.empty_strided(s, st, dtype=d, device="meta") for s, st, d in request["batch"]
    ]
    fake_batch(mode, stand_ins, frozenset(map(tuple, request["dynamic"])))
    cached = step_cache.load(name, key, mode)
    if cached is None:
        return 1
    example = [step_values.decode(code, mode) for code in request["example"]]
    gm = cached.step_gm
    set_kernel_backend(gm, "inductor")
    specs = block_specs(gm)
    with remembered_key(gm, key, name, {"block_specs": specs}):
        compile_step(gm, example, "inductor", request["options"], cached=True)
    compile_block_kernels(specs, False, partial(compile_noted_kernel, name))
    return 0
