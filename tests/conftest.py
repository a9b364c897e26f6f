"""Test setup: on a machine without CUDA, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before any kernel module is imported, hence here, first.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # A pytest-xdist worker takes its share of the cores, and so does what it starts (vLLM's CPU engine, Inductor's
    # compile workers, spawned ranks): otherwise each worker's engine binds OpenMP threads to every core and the
    # workers' spinning threads take turns on the same cores (the vLLM engine tests ran 3x slower).
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)))
    for _name, _value in (("OMP_NUM_THREADS", _threads), ("TORCHINDUCTOR_COMPILE_THREADS", _threads),
                          ("VLLM_CPU_OMP_THREADS_BIND", "nobind")):
        os.environ.setdefault(_name, _value)
    torch.set_num_threads(int(_threads))

import pytest  # noqa: E402


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter re-patches triton.language (inspect.getmembers over tl, tl.tensor, tl.math)
    at every call of a nested @triton.jit function, though the launch around it patched the same modules
    already and restores them when it ends: a third of an interpreted expert kernel's time. Inside a
    launch, a nested call whose language modules are patched already (by the launch, or by a nested call
    before it, whose patches Triton never restores) skips it; anything else takes Triton's own path.
    Only the interpreter's speed changes; where its internals differ from what this expects, nothing
    is patched."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if original is None or executor is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    import triton.language as tl
    launches: list[list] = []  # per launch in progress: [its language modules, patched yet]

    def langs(fn) -> set[int]:
        return {id(v) for v in getattr(fn, "__globals__", {}).values() if v is tl or v is tl.core}

    def patch_lang(fn):
        if launches and launches[-1][1] and langs(fn) <= launches[-1][0]:
            return interpreter._LangPatchScope()  # patched by the launch, which restores it
        scope = original(fn)
        if launches:  # the launch's own call comes first; a nested call's patches last the launch out
            launches[-1][0] |= langs(fn)
            launches[-1][1] = True
        return scope

    run = executor.__call__

    def call(self, *args, **kwargs):
        launches.append([langs(self.fn), False])
        try:
            return run(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch_lang
    executor.__call__ = call


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once_per_launch()


# ---- the AOT compile check, in the background ---------------------------------------------------------------

AOT_TEST = "test_kernels_aot.py::test_every_kernel_compiles_for_every_target"
_AOT_RUN = pytest.StashKey["AotRun"]()
_AOT_DIR = "minimax_aot_dir"  # an xdist worker's workerinput key: where the controller's run writes


class AotRun:
    """The AOT compile check (python -m minimax_ops.kernels.aot_check) run in the background at the lowest CPU
    priority, so that it compiles on the cores the tests leave idle: it writes aot.json, aot.log and, when it
    ends, its exit status to rc in ``folder``. The process that starts it (pytest itself, or under pytest-xdist
    the controller) stops it at the end of the session; the AOT test, wherever it runs, waits for rc."""

    def __init__(self, folder: str):
        self.folder = folder
        self.report, self.log, self.rc = (os.path.join(folder, n) for n in ("aot.json", "aot.log", "rc"))
        self.proc = None

    def start(self) -> "AotRun":
        from utils import ROOT, aot_env  # (tests/ is on the path once conftest runs)
        check = [sys.executable, "-m", "minimax_ops.kernels.aot_check", "--json", self.report,
                 "-j", str(os.cpu_count() or 1)]
        write_rc = "import subprocess, sys; rc = subprocess.call(sys.argv[2:]); open(sys.argv[1], 'w').write(str(rc))"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-c", write_rc, self.rc, *check], cwd=ROOT, env=aot_env(),
                                         stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=lambda: os.nice(19))
        return self

    def wait(self, timeout: float) -> int:
        """The check's exit status, once it has ended (TimeoutError after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while not (status := self._status()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the AOT check did not end in {timeout:.0f} s (log: {self.log})")
            time.sleep(2)
        return int(status)

    def _status(self) -> str:
        if not os.path.exists(self.rc):
            return ""
        with open(self.rc) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:  # (a run stopped early: -x, ^C)
            os.killpg(self.proc.pid, signal.SIGKILL)  # its compiler processes too
            self.proc.wait()


def pytest_collection_modifyitems(session, config, items):
    """The AOT check starts when its test is collected (by the controller under pytest-xdist, once, when a worker
    reports it), and its test moves to the end of the run: its file after every other."""
    aot = [item for item in items if item.nodeid.endswith(AOT_TEST)]
    if not aot:
        return
    last = [item for item in items if item.path == aot[0].path and item not in aot] + aot
    items[:] = [item for item in items if item not in last] + last
    if not hasattr(config, "workerinput"):
        config.stash[_AOT_RUN] = AotRun(tempfile.mkdtemp(prefix="minimax_aot_run_")).start()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist controller: every worker learns the folder of the one AOT run."""
    if _AOT_RUN not in node.config.stash:
        node.config.stash[_AOT_RUN] = AotRun(tempfile.mkdtemp(prefix="minimax_aot_run_"))
    node.workerinput[_AOT_DIR] = node.config.stash[_AOT_RUN].folder


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    run = node.config.stash[_AOT_RUN]
    if run.proc is None and any(i.endswith(AOT_TEST) for i in ids):
        run.start()


@pytest.fixture
def aot_background(request) -> AotRun | None:
    """The background AOT check of this session (its own, or under pytest-xdist the controller's), or None."""
    workerinput = getattr(request.config, "workerinput", None)
    if workerinput is not None:
        return AotRun(workerinput[_AOT_DIR]) if _AOT_DIR in workerinput else None
    return request.config.stash.get(_AOT_RUN, None)


def pytest_sessionfinish(session, exitstatus):
    run = session.config.stash.get(_AOT_RUN, None)
    if run is not None:
        run.stop()


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def minimax_log(caplog):
    """Each refusal reason is logged once per process: forget earlier ones, capture the logger."""
    import logging

    from minimax_ops.log import reset_log_once
    reset_log_once()
    caplog.set_level(logging.INFO, logger="minimax_ops")
    return caplog


def minimax_reasons(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "minimax_ops"]


@pytest.fixture
def one_rank_group():
    """The name of a one-rank process group of this process (NCCL on a GPU, capturable; gloo on the CPU): its
    all-reduces sum one partial, so a tensor-parallel layer's results are its TP 1 results."""
    import torch.distributed as dist
    assert not dist.is_initialized(), "a process group is already set up in this process"
    if torch.cuda.is_available():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
