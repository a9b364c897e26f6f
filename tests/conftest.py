"""Test setup: on a machine without CUDA, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before any kernel module is imported, hence here, first.
"""

import os
import subprocess
import sys
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
_AOT_RUN = pytest.StashKey[dict]()


def pytest_collection_modifyitems(session, config, items):
    """The AOT compile check (tests/test_kernels_aot.py: some 20 CPU-minutes on CI's 2 cores) starts when
    its test is collected, in the background at the lowest CPU priority, so that it compiles on the cores
    the other tests leave idle; its test moves to the end of the run and collects the result."""
    aot = [item for item in items if item.nodeid.endswith(AOT_TEST)]
    if not aot:
        return
    items[:] = [item for item in items if item not in aot] + aot
    from utils import ROOT, aot_env  # (tests/ is on the path once conftest runs)

    out = tempfile.mkdtemp(prefix="minimax_aot_run_")
    report, log = os.path.join(out, "aot.json"), os.path.join(out, "aot.log")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "minimax_ops.kernels.aot_check", "--json", report, "-j", str(os.cpu_count() or 1)],
            cwd=ROOT, env=aot_env(), stdout=f, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(19))
    config.stash[_AOT_RUN] = {"proc": proc, "report": report, "log": log}


@pytest.fixture
def aot_background(request) -> dict | None:
    """The background AOT check this session started ({proc, report, log}), or None."""
    return request.config.stash.get(_AOT_RUN, None)


def pytest_sessionfinish(session, exitstatus):
    run = session.config.stash.get(_AOT_RUN, None)
    if run is not None and run["proc"].poll() is None:  # (a run stopped early: -x, ^C)
        run["proc"].kill()
        run["proc"].wait()


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
