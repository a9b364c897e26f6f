"""Tile / split sweep of the weight-streaming decode kernels (mx_linear, route, moe_experts) on one GPU.

    PYTHONPATH=$PWD python3 benchmarks/sweep_kernels.py [--sections final,pattern,route,moe,lin]
        [--tokens 1,4,16] [--formats mxfp4,mxfp8] [--budget 270] [--workers 12] [--out DIR]

Sections: final (the heuristics as encoded in the kernels, config=None), pattern (a read-only
kernel walking the weight in GEMV tile patterns: the memory system's ceiling for each pattern),
route (RouterConfig grid), moe (coordinate search: w13 tiles x splits with w2 at its default, then
w2 with the best w13; plus default tiles with / without the MXFP4 PTX decode), lin (MXFP8 qkv and
o_proj tiles x splits x K chunks). The grids (sweep_kernels_jobs.py) are the last run's; earlier runs' grids
are described in the comments of the kernels' tile tables.

Real-size random weights (random bytes: every code but fp8 NaN, scales 2^-9..2^-3), timed from
CUDA-graph replay: one graph holds one call per weight copy (mx_linear: 4 copies of 60 MB; route:
24 x 3 MB gates) or per routing (moe_experts: 3 routings over the 128-expert tables, disjoint
experts at 1 token), so L2 (60 MB) never holds what a call streams; the median over replays
divided by the calls per graph is one call. Every timed config is first checked against a
reference (mx_linear: fp32 matmul on the dequantised weight; moe_experts: an unsplit config;
route: torch top-k of the scores). TB/s counts the weight and scale bytes a call must read (moe:
the distinct experts of the routing plus the shared expert). Kernels are compiled up front by
--workers processes into one Triton cache (each launch's specialisation reproduced with stride-0
expert tables); --wait-pid holds the timing until another GPU job (the tests) has finished.
Prints the best config per case, 'emit' lines (winners aggregated over cases, in the form of the
kernels' tables), and writes every row to DIR/sweep.json and DIR/sweep.log.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
import time

import torch

from sweep_kernels_jobs import (  # (benchmarks/ is on the path of a script run from it)
    FMT_CODES, H, I, LIN_SHAPES, OLD_LIN, TOPK, Env, call, default_moe_tiles, lin_grid, moe_grid, nbytes,
    pattern_jobs, reps, route_grid)


def compile_worker(jobs: list[dict]) -> list[str]:
    env = Env(torch.device("cuda"), light=True)
    errors = []
    for job in jobs:
        try:
            call(job, env, 0)
        except Exception as e:  # reported again when the job is timed
            errors.append(f"{job['label']}: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.synchronize()
    return errors


# ---- timing --------------------------------------------------------------------------------------------------

def time_graph(fns, iters: int = 25) -> float:
    """Median microseconds per call over graph replays of all fns back to back."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    del g
    return statistics.median(times)


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


class Runner:
    def __init__(self, env: Env, deadline: float, bw: float):
        self.env, self.deadline, self.bw = env, deadline, bw
        self.rows, self.refs = [], {}
        self.log = None

    def reference(self, job):
        env = self.env
        if job["kind"] == "lin":
            from minimax_ops.formats import dequantize
            n, k = job["shape"]
            w, s = env.lin(n, k, 0)
            return ("lin", job["shape"], job["m"]), lambda: env.x(job["m"], k).float() @ dequantize(w, s).T
        if job["kind"] == "moe":
            from minimax_ops.kernels.tiles import ExpertTiles
            code = FMT_CODES[job["fmt"]]
            safe = dataclasses.replace(default_moe_tiles(code, job["n"])[0], split=1), \
                dataclasses.replace(default_moe_tiles(code, job["n"])[1], split=1)
            assert isinstance(safe[0], ExpertTiles)
            return ("moe", job["fmt"], job["n"]), lambda: call(dict(job, t13=safe[0], t2=safe[1]), env, 0)
        return None, None

    def check(self, job, out) -> str:
        if job["kind"] == "pattern":
            return ""
        if job["kind"] == "route":
            weights, ids = out
            gate, bias = self.env.gate()
            scores = torch.sigmoid(self.env.h(job["n"]).float() @ gate.T)
            want = (scores + bias).topk(TOPK, dim=-1).values
            got = (scores + bias).gather(1, ids.long())
            ok = torch.allclose(got, want, rtol=1e-4, atol=1e-5) and torch.allclose(
                weights.sum(-1), torch.full_like(weights[:, 0], 2.0), rtol=1e-4)
            return "" if ok else "route mismatch"
        key, make = self.reference(job)
        if key not in self.refs:
            self.refs[key] = make()
        err = rel_err(out, self.refs[key])
        return "" if err < 2e-2 else f"rel err {err:.3g}"

    def run(self, job) -> dict | None:
        if time.time() > self.deadline:
            return None
        row = {"label": job["label"], **{k: v for k, v in job.items() if k not in ("cfg", "t13", "t2", "label")}}
        for k in ("cfg", "t13", "t2"):
            if k in job:
                row[k] = dataclasses.asdict(job[k]) if dataclasses.is_dataclass(job[k]) else job[k]
        try:
            err = self.check(job, call(job, self.env, 0))
            us = time_graph([lambda r=r: call(job, self.env, r) for r in range(reps(job))])
            row.update(us=us, bytes=nbytes(job, self.env), error=err)
            row["tbps"] = row["bytes"] / (us * 1e-6) / 1e12
            row["pct"] = 100 * row["bytes"] / (us * 1e-6) / self.bw
        except Exception as e:
            row.update(us=float("inf"), error=f"{type(e).__name__}: {str(e)[:300]}")
        self.rows.append(row)
        if self.log:
            tb = f"{row['us']:8.1f} us {row.get('tbps', 0):5.2f} TB/s" if row["us"] < float("inf") else "   failed"
            self.log.write(f"{tb}  {row['label']}  {row.get('error', '')}\n")
            self.log.flush()
        return row


# ---- sections ------------------------------------------------------------------------------------------------

def label_lin(shape, m, cfg):
    return (f"lin {shape[0]}x{shape[1]} M{m} bn{cfg.block_n} bk{cfg.block_k}x{cfg.k_chunks} w{cfg.num_warps} "
            f"s{cfg.num_stages} split{cfg.split_k}{'' if cfg.fused_reduce else ' partials'}")


def lin_jobs(tokens, quick):
    from minimax_ops.kernels.tiles import GemvConfig
    jobs = []
    for shape in LIN_SHAPES:
        for m in tokens:
            cfgs = [GemvConfig(**OLD_LIN)] + [c for c in lin_grid(quick)
                                              if (shape[1] // (c.block_k * c.k_chunks)) % c.split_k == 0]
            for cfg in cfgs:
                jobs.append({"kind": "lin", "shape": shape, "m": m, "cfg": cfg, "label": label_lin(shape, m, cfg)})
    return jobs


def label_tiles(t):
    return (f"n{t.block_n} k{t.block_k}x{t.k_chunks} w{t.num_warps} s{t.num_stages} split{t.split}"
            f"{'' if t.ptx is None else f' ptx{int(t.ptx)}'}")


def moe_job(fmt, n, t13, t2, step):
    return {"kind": "moe", "fmt": fmt, "n": n, "t13": t13, "t2": t2, "step": step,
            "label": f"moe {fmt} n{n} w13[{label_tiles(t13)}] w2[{label_tiles(t2)}]"}


def moe_fixed_jobs(fmt, n):
    """Default tiles unsplit (the correctness reference) and, for MXFP4, with and without PTX decode."""
    t13, t2 = default_moe_tiles(FMT_CODES[fmt], n)
    safe = (dataclasses.replace(t13, split=1), dataclasses.replace(t2, split=1))
    jobs = [moe_job(fmt, n, *safe, "safe")]
    if fmt != "mxfp8":
        jobs += [moe_job(fmt, n, *(dataclasses.replace(t, ptx=p) for t in safe), f"ptx{int(p)}") for p in (True, False)]
    return jobs


def moe_jobs_step(fmt, n, which, fixed, quick):
    jobs = []
    for t in moe_grid(fmt, which, quick):
        if which == "w13" and (H // (t.block_k * t.k_chunks)) % t.split:
            continue
        if which == "w2" and (I // (t.block_k * t.k_chunks)) % t.split:
            continue
        t13, t2 = (t, fixed) if which == "w13" else (fixed, t)
        jobs.append(moe_job(fmt, n, t13, t2, which))
    return jobs


def route_jobs(tokens, quick):
    return [{"kind": "route", "n": n, "cfg": cfg, "label": f"route n{n} e{cfg.block_e} h{cfg.block_h} split{cfg.split} "
                                                           f"logits{cfg.logits} fused{int(cfg.fused_topk)}"}
            for n in tokens for cfg in route_grid(quick)]


def final_jobs(tokens, formats):
    """The heuristics as encoded in the kernels (config=None)."""
    jobs = [{"kind": "lin", "shape": shape, "m": m, "cfg": None, "step": "final",
             "label": f"final lin {shape[0]}x{shape[1]} M{m}"} for shape in LIN_SHAPES for m in tokens]
    jobs += [{"kind": "route", "n": n, "cfg": None, "step": "final", "label": f"final route n{n}"} for n in tokens]
    jobs += [{"kind": "moe", "fmt": fmt, "n": n, "t13": None, "t2": None, "step": "final",
              "label": f"final moe {fmt} n{n}"} for fmt in formats for n in tokens]
    return jobs


def emit(rows, note):
    """Winners aggregated over shapes / step sizes (mean of time over the best time per case), in
    the form of the kernels' tables."""
    def agg(cases, key):
        score = {}
        for case in cases:
            ok = [r for r in case if "tbps" in r and not r.get("error")]
            if not ok:
                continue
            top = min(r["us"] for r in ok)
            per = {}
            for r in ok:
                per[key(r)] = min(per.get(key(r), float("inf")), r["us"] / top)
            for k, v in per.items():
                score.setdefault(k, []).append(v)
        full = max((len(v) for v in score.values()), default=0)
        ranked = sorted((statistics.mean(v), k) for k, v in score.items() if len(v) == full)
        return ranked[:3]
    lin = [r for r in rows if r["kind"] == "lin" and r.get("cfg")]
    cases = {}
    for r in lin:
        cases.setdefault((tuple(r["shape"]), r["m"]), []).append(r)
    tile = lambda r: (r["cfg"]["block_n"], r["cfg"]["block_k"], r["cfg"]["num_warps"], r["cfg"]["num_stages"],
                      r["cfg"]["k_chunks"])
    note(f"emit mx_linear MXFP8 tiles (mean t/best): {agg(cases.values(), tile)}")
    for (shape, m), case in sorted(cases.items()):
        b = min((r for r in case if "tbps" in r and not r.get("error")), key=lambda r: r["us"], default=None)
        if b:
            note(f"emit   {shape} M{m}: {tile(b)} split {b['cfg']['split_k']} {b['us']:.1f} us")
    for fmt in ("mxfp4", "mxfp8", "mxfp4p"):
        for which, key in (("w13", "t13"), ("w2", "t2")):
            cases = {}
            for r in rows:
                if r["kind"] == "moe" and r["fmt"] == fmt and r.get("step") == which:
                    cases.setdefault(r["n"], []).append(r)
            if cases:
                t = lambda r: (r[key]["block_n"] * (2 if which == "w13" else 1), r[key]["block_k"], r[key]["num_warps"],
                               r[key]["num_stages"], r[key]["k_chunks"])
                note(f"emit moe {fmt} {which} (rows, bk, warps, stages, chunks): {agg(cases.values(), t)}")
                for n, case in sorted(cases.items()):
                    b = min((r for r in case if "tbps" in r and not r.get("error")), key=lambda r: r["us"], default=None)
                    if b:
                        note(f"emit   n{n}: {t(b)} split {b[key]['split']} {b['us']:.1f} us")
    cases = {}
    for r in rows:
        if r["kind"] == "route" and r.get("cfg") is not None:
            cases.setdefault(r["n"], []).append(r)
    note(f"emit router: {agg(cases.values(), lambda r: tuple(r['cfg'].values()))}")


def best(rows, **match):
    ok = [r for r in rows if all(r.get(k) == v for k, v in match.items()) and not r.get("error") and r["us"] < float("inf")
          and r.get("step") != "final"]
    return min(ok, key=lambda r: r["us"]) if ok else None


def precompile(jobs, workers):
    if workers <= 1 or not jobs:
        return
    t0 = time.time()
    chunks = [jobs[i::workers] for i in range(workers)]
    with futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = [e for errs in pool.map(compile_worker, chunks) for e in errs]
    print(f"precompiled {len(jobs)} launches in {time.time() - t0:.0f}s ({len(errors)} errors)", flush=True)
    for e in errors[:10]:
        print("  compile error:", e, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="lin,moe,route")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--formats", default="mxfp4,mxfp8")
    ap.add_argument("--budget", type=float, default=270, help="seconds; later jobs are skipped past it")
    ap.add_argument("--workers", type=int, default=12, help="compile processes (0: compile while timing)")
    ap.add_argument("--quick", action="store_true", help="a few configs per grid")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--wait-pid", type=int, default=0, help="time nothing until this process has exited")
    ap.add_argument("--final-tokens", default="", help="tokens for the final section (default: --tokens)")
    ap.add_argument("--final-formats", default="", help="formats for the final section (default: --formats)")
    args = ap.parse_args(argv)
    start = time.time()
    sections = args.sections.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    formats = args.formats.split(",")
    device = torch.device("cuda")
    from minimax_ops.bench import copy_bandwidth
    bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)

    jobs = []
    if "lin" in sections:
        jobs += lin_jobs(tokens, args.quick)
    step1 = {}
    if "moe" in sections:
        for fmt in formats:
            for n in tokens:
                fixed13, fixed2 = default_moe_tiles(FMT_CODES[fmt], n)
                step1[(fmt, n)] = moe_jobs_step(fmt, n, "w13", fixed2, args.quick)
                jobs += step1[(fmt, n)] + moe_jobs_step(fmt, n, "w2", fixed13, args.quick) + moe_fixed_jobs(fmt, n)
    if "route" in sections:
        jobs += route_jobs(tokens, args.quick)
    if "pattern" in sections:
        jobs += pattern_jobs()
    final_tokens = [int(t) for t in args.final_tokens.split(",")] if args.final_tokens else tokens
    final_formats = args.final_formats.split(",") if args.final_formats else formats
    if "final" in sections:
        jobs += final_jobs(final_tokens, final_formats)
    precompile(jobs, args.workers)

    while args.wait_pid and time.time() < start + args.budget - 20:
        try:
            os.kill(args.wait_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(1)
    print(f"timing from {time.time() - start:.0f}s", flush=True)
    env = Env(device, light=False)
    runner = Runner(env, start + args.budget, bw)
    os.makedirs(args.out, exist_ok=True)
    runner.log = open(os.path.join(args.out, "sweep.log"), "w")
    summary = []

    def note(line):
        summary.append(line)
        print(line, flush=True)

    if "final" in sections:
        note("final (heuristics as encoded):")
        for job in final_jobs(final_tokens, final_formats):
            r = runner.run(job)
            if r and "tbps" in r:
                note(f"  {r['label']:34s} {r['us']:8.1f} us {r['tbps']:5.2f} TB/s {r['pct']:4.0f}% "
                               f"{r.get('error', '')}")
    if "pattern" in sections:
        for job in pattern_jobs():
            r = runner.run(job)
            if r and "tbps" in r:
                note(f"{r['label']:44s} {r['us']:7.1f} us {r['tbps']:5.2f} TB/s ({r['pct']:.0f}%)")

    if "route" in sections:
        for job in route_jobs(tokens, args.quick):
            runner.run(job)
        for n in tokens:
            b = best(runner.rows, kind="route", n=n)
            if b:
                note(f"route n={n}: best {b['label']}: {b['us']:.1f} us ({b['tbps']:.2f} TB/s)")
    if "moe" in sections:
        for fmt in formats:
            for n in tokens:
                for job in step1[(fmt, n)]:
                    runner.run(job)
                b13 = best(runner.rows, kind="moe", fmt=fmt, n=n, step="w13")
                t13 = _tiles(b13["t13"]) if b13 else default_moe_tiles(FMT_CODES[fmt], n)[0]
                for job in moe_jobs_step(fmt, n, "w2", t13, args.quick):
                    runner.run(job)
                b = best(runner.rows, kind="moe", fmt=fmt, n=n, step="w2")
                for job in moe_fixed_jobs(fmt, n):
                    runner.run(job)
                if b:
                    note(f"moe {fmt} n={n}: best {b['label']}: {b['us']:.1f} us {b['tbps']:.2f} TB/s "
                                   f"({b['pct']:.0f}%)")
                fixed = [best(runner.rows, kind="moe", fmt=fmt, n=n, step=st) for st in ("safe", "ptx1", "ptx0")]
                note("    default tiles unsplit: " + ", ".join(
                    f"{r['step']} {r['us']:.1f} us" for r in fixed if r))

    if "lin" in sections:
        for job in lin_jobs(tokens, args.quick):
            runner.run(job)
        for shape in LIN_SHAPES:
            for m in tokens:
                b = best(runner.rows, kind="lin", shape=shape, m=m)
                old_cfg = dataclasses.asdict(_gemv(OLD_LIN))
                old = next((r for r in runner.rows if r["kind"] == "lin" and r["shape"] == shape and r["m"] == m
                            and r["cfg"] == old_cfg and "tbps" in r), None)
                if b:
                    win = b["cfg"]
                    same = [r for r in runner.rows if r["kind"] == "lin" and r["shape"] == shape and r["m"] == m
                            and "tbps" in r and r.get("cfg") and r["cfg"]["split_k"] == 4 and all(
                                r["cfg"][k] == win[k] for k in ("block_n", "block_k", "num_warps", "num_stages"))]
                    cmp = ", ".join(f"{'fused' if r['cfg']['fused_reduce'] else 'partials'} {r['us']:.1f}" for r in same)
                    note(f"lin {shape} M={m}: best {b['label']}: {b['us']:.1f} us {b['tbps']:.2f} TB/s "
                                   f"({b['pct']:.0f}%)" + (f"; old {old['us']:.1f} us {old['tbps']:.2f} TB/s" if old else "")
                                   + (f"; split4 reduce: {cmp}" if cmp else ""))
    emit(runner.rows, note)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(runner.rows, f, indent=0, default=str)
    bad = [r for r in runner.rows if r.get("error")]
    for r in bad[:20]:
        print(f"FAILED {r['label']}: {r['error']}")
    print(f"\n{len(runner.rows)} timed, {len(bad)} failed, {time.time() - start:.0f}s")
    print("==== summary\n" + "\n".join(summary))
    return 0


def _gemv(d):
    from minimax_ops.kernels.tiles import GemvConfig
    return GemvConfig(**d)


def _tiles(d):
    from minimax_ops.kernels.tiles import ExpertTiles
    return ExpertTiles(**d)


if __name__ == "__main__":
    sys.exit(main())
