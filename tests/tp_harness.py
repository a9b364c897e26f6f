"""Multi-process harness for the tensor-parallel tests: spawn ranks on gloo, bounded in time.

``run_ranks(world, fn, workdir, **kwargs)`` starts ``world`` spawned processes; each joins a gloo
group (FileStore rendezvous in workdir, collective timeout TIMEOUT_S), calls ``fn(rank, world,
workdir, **kwargs)`` (a module-level function, so spawn can find it) and saves the dict it returns.
A rank that raises saves its exception's type name and text instead. A rank still running at the
deadline is killed and the test fails: a hung rank fails the test, never hangs CI.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60  # gloo's collective timeout: a rank waiting on a dead peer errors out after this


def _entry(fn, rank: int, world: int, workdir: str, kwargs: dict) -> None:
    out = pathlib.Path(workdir) / f"rank{rank}.pt"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(pathlib.Path(workdir) / f"inductor{rank}")
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        result = {"ok": fn(rank, world, workdir, **kwargs)}
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        result = {"error": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, out)


def run_ranks(world: int, fn, workdir: pathlib.Path, *, deadline_s: float, **kwargs) -> list[dict]:
    """Each rank's saved result ({"ok": ...} or {"error": name, "message": ..., "traceback": ...})."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, rank, world, str(workdir), kwargs)) for rank in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    assert not hung, f"ranks {hung} of {world} were still running after {deadline_s} s"
    results = []
    for rank, p in enumerate(procs):
        path = workdir / f"rank{rank}.pt"
        assert path.exists(), f"rank {rank} exited with code {p.exitcode} and saved no result"
        results.append(torch.load(path, weights_only=False))
    return results


def unwrap(results: list[dict]) -> list:
    """The ranks' return values; any rank's error fails with its traceback."""
    for rank, r in enumerate(results):
        assert "ok" in r, f"rank {rank} raised {r['error']}: {r['message']}\n{r['traceback']}"
    return [r["ok"] for r in results]
