"""Every Triton kernel compiles ahead of time for CUDA sm_90 and AMD gfx942 / gfx950, no GPU needed.

The check runs in a subprocess because the interpreter (TRITON_INTERPRET=1, set by conftest on
CPU machines) replaces @triton.jit functions in this process; the real compiler needs them intact.
conftest starts it in the background when its test is collected and runs that test (and its file) last.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minimax_ops.kernels.aot import EVERY_SPEC_IF_WGMMA, TARGETS
from utils import ROOT, aot_env


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=aot_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_every_kernel_compiles_for_every_target(aot_background):
    assert aot_background is not None, "conftest starts the check when this test is collected"
    returncode = aot_background.wait(timeout=1500)
    report, log = Path(aot_background.report), Path(aot_background.log).read_text()[-6000:]
    assert report.exists(), f"aot_check wrote no report (exit {returncode}):\n{log}"
    data = json.loads(report.read_text())

    assert not data["broken"], f"kernel modules that fail to import or list specs: {data['broken']}\n{log}"
    failed = [f"{r['target']} {r['module']}.{r['name']}: {(r['error'].strip().splitlines() or [''])[-1][:200]}"
              for r in data["results"] if not r["ok"]]
    assert not failed, f"{len(failed)} AOT compiles failed: {failed}\n{log}"
    # Every @triton.jit function of minimax_ops/kernels/*.py is in some aot_specs() or called by one that is.
    assert not data["uncovered"], f"kernels missing from aot_specs(): {data['uncovered']}"
    assert any(data["modules"].values()), "found no @triton.jit functions at all"
    labels = [f"{t[0]}:{t[1]}" for t in TARGETS]
    compiled = {label: {(r["module"], r["kernel"]) for r in data["results"] if r["target"] == label}
                for label in labels}
    for label, kernels in compiled.items():
        assert kernels, f"no kernel was compiled for {label}"
        # each chip compiles a cover of the specs (aot.cover), and still every kernel its backend does
        backend = label.split(":")[0]
        same_backend = set().union(*(k for other, k in compiled.items() if other.startswith(f"{backend}:")))
        assert kernels == same_backend, f"{label} misses {sorted(same_backend - kernels)}"
    # where a compile issued wgmma (aot.EVERY_SPEC_IF_WGMMA), every spec of its kernel was compiled there
    wanted = {(m, k, t): n for m, k, t, n in data["specs"]}
    for module, kernel, label in {(r["module"], r["kernel"], r["target"]) for r in data["results"]
                                  if r["wgmma"] and r["target"] in EVERY_SPEC_IF_WGMMA}:
        done = sum((r["module"], r["kernel"], r["target"]) == (module, kernel, label) for r in data["results"])
        assert done == wanted[module, kernel, label], f"{label} {module}.{kernel}: {done} specs compiled"
    assert returncode == 0, f"aot_check exited {returncode}:\n{log}"


CHECKER_PROBE = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import triton, triton.language as tl
    from minimax_ops.kernels import aot_check
    from minimax_ops.kernels.aot import KernelSpec
    import probe_kernels as m

    specs = [KernelSpec(m.scale_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32"}, {"BLOCK": 64, "CUBE": False},
                        name="good"),
             KernelSpec(m.scale_kernel, {"x_ptr": "*fp32", "n": "i32"}, {"BLOCK": 64}, name="missing_arg")]
    loaded = aot_check.ModuleSpecs("probe_kernels", specs, aot_check.jit_functions(m), module="probe_kernels")
    aot_check._LOADED["probe_kernels"] = loaded
    results = [aot_check.run_one("probe_kernels", i, ("cuda", 90, 32)) for i in range(2)]
    out = {"jit": sorted(loaded.jit), "uncovered": aot_check.uncovered([loaded]),
           "not_compiled": aot_check.not_compiled([loaded], results), "results": [r.__dict__ for r in results]}
    print(json.dumps(out))
''')

PROBE_KERNELS = textwrap.dedent('''
    import triton
    import triton.language as tl

    @triton.jit
    def _twice(x):
        return x * 2.0

    @triton.jit
    def _cube(x):
        return x * x * x

    @triton.jit
    def scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, CUBE: tl.constexpr = False):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        if CUBE:  # no spec sets it: _cube is called in the source but never compiled
            x = _cube(x)
        tl.store(y_ptr + offs, _twice(x), mask=offs < n)

    @triton.jit
    def orphan_kernel(x_ptr):
        pass
''')


def test_checker_flags_orphans_and_bad_signatures(tmp_path):
    """The checker itself: a helper compiled into a listed kernel is covered; an unlisted kernel is not,
    nor a helper behind a constexpr branch no spec takes; a spec that misses an argument fails with a
    message naming it (a defaulted constexpr may be left out); a good spec really compiles."""
    (tmp_path / "probe_kernels.py").write_text(PROBE_KERNELS)
    (tmp_path / "probe.py").write_text(CHECKER_PROBE)
    proc = _run([str(tmp_path / "probe.py"), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["jit"] == ["_cube", "_twice", "orphan_kernel", "scale_kernel"]
    assert out["uncovered"] == ["probe_kernels.orphan_kernel"]  # the source estimate of --list
    assert sorted(out["not_compiled"]) == ["probe_kernels._cube", "probe_kernels.orphan_kernel"]
    good, bad = out["results"]
    assert good["ok"], good["error"]
    # A CUDA compile reports what one program holds, read from its cubin (cubin_resources).
    regs, stack, smem = (int(good["resources"].split()[i]) for i in (1, 3, 5))
    assert 0 < regs <= 255 and stack >= 0 and smem >= 0 and good["resources"].endswith("a SM)"), good["resources"]
    assert not bad["ok"] and "missing ['y_ptr']" in bad["error"]


def test_spec_targets_restrict_where_a_spec_compiles():
    """A spec naming its targets (e.g. a CUDA-only PTX path) is compiled for those alone."""
    from minimax_ops.kernels.aot import KernelSpec
    from minimax_ops.kernels.aot_check import spec_wants
    spec = KernelSpec(kernel=None, signature={})
    assert [spec_wants(spec, t) for t in TARGETS] == [True] * len(TARGETS)
    spec.targets = ("cuda",)
    assert [spec_wants(spec, t) for t in TARGETS] == [t[0] == "cuda" for t in TARGETS]
    spec.targets = ("gfx950",)
    assert [spec_wants(spec, t) for t in TARGETS] == [t[1] == "gfx950" for t in TARGETS]


def test_each_target_compiles_a_cover_and_cuda_every_spec_of_a_wgmma_kernel():
    """Each target compiles a subset of the specs in which each kernel still meets every value each of its
    constexprs and num_warps takes (the AMD chips each their own where ties allow); on the targets of
    aot.EVERY_SPEC_IF_WGMMA a compile that issued wgmma brings in the rest of its kernel's specs, once."""
    from minimax_ops.kernels.aot import COVER_FROM_END, KernelSpec, cover
    from minimax_ops.kernels.aot_check import Result, compiled_on, more_specs, target_label

    def a():  # two kernels
        pass

    def b():
        pass

    specs = [KernelSpec(a, {}, {"X": 1, "Y": True}, num_warps=4), KernelSpec(a, {}, {"X": 2, "Y": True}, num_warps=4),
             KernelSpec(a, {}, {"X": 1, "Y": False}, num_warps=4), KernelSpec(a, {}, {"X": 2, "Y": False}, num_warps=8),
             KernelSpec(b, {}, {"X": 1}, num_warps=4)]
    chosen = cover(specs)
    assert chosen == [0, 3, 4]  # a's five values in two specs (the first of four tied at three), then b
    seen = {(id(specs[i].kernel), k, v) for i in chosen for k, v in [*specs[i].constexprs.items(),
                                                                  ("num_warps", specs[i].num_warps)]}
    assert seen == {(id(s.kernel), k, v) for s in specs for k, v in [*s.constexprs.items(), ("num_warps", s.num_warps)]}
    twins = [specs[4], specs[4]]  # a tie: the first in list order, or the last from the end
    assert cover(twins) == [0] and cover(twins, from_end=True) == [1]
    for target in TARGETS:
        label = target_label(target)
        assert compiled_on(specs, target) == chosen
        assert compiled_on(twins, target) == ([1] if label in COVER_FROM_END else [0])
        issued = Result("m", "spec0", "a", label, ok=True, wgmma=2)  # a compile of specs[0] that issued wgmma
        assert more_specs(specs, issued, target, set(chosen)) == ([1, 2] if label in EVERY_SPEC_IF_WGMMA else [])
        assert more_specs(specs, issued, target, {*chosen, 1, 2}) == []  # given once
        for other in (dataclasses.replace(issued, wgmma=0), dataclasses.replace(issued, ok=False)):
            assert more_specs(specs, other, target, set(chosen)) == []
    assert "cuda:90" in EVERY_SPEC_IF_WGMMA  # where the race check's subject is compiled in every spec
    amd = [target_label(t) for t in TARGETS if t[0] == "hip"]
    assert set(COVER_FROM_END) <= set(amd) and any(label not in COVER_FROM_END for label in amd)  # two covers


FRAGMENT_PROBE = textwrap.dedent('''
    import json, re
    from minimax_ops.kernels import aot_check, linear_mma, moe_mma, qkv_mma
    from minimax_ops.kernels.aot import cover

    # Divisibility the launches guarantee (mma_launch.check_aligned checks strides; Triton specialises
    # pointers and integers divisible by 16).
    SIXTEEN = ("k_blocks", "hidden", "inter", "inter_shared", "N")
    out, evict = {}, {}
    # (qkv_mma: its GEMV with the norm / RoPE / insert epilogue, whose layout must not leak into it)
    launched = [spec for spec in moe_mma.aot_specs() + linear_mma.aot_specs() + qkv_mma.aot_specs()
                if spec.constexprs["PTX"] and not spec.constexprs["PDL"] and spec.constexprs.get("SEG_TOKENS", 1) == 1]
    for spec in [launched[i] for i in cover(launched)]:  # every value of every constexpr and num_warps
        asm = aot_check.compile_as_launched(spec, ("cuda", 90, 32), SIXTEEN).asm
        ttgir = asm["ttgir"]
        evict[spec.label()] = [bool(spec.constexprs.get("EVICT_FIRST")), "L2::evict_first" in asm["ptx"]]
        layouts = dict(re.findall(r"(#(?:blocked|linear)[0-9]*) = (#ttg.(?:blocked|linear)<[^>]*>)", ttgir))
        found = [layouts[m.group(1)] for m in re.finditer(
            r"elementwise_inline_asm [^\\n]*mma.sync[^\\n]*-> tensor<[^,]*, (#(?:blocked|linear)[0-9]*)>", ttgir)]
        out[spec.label()] = found
    print(json.dumps({"layouts": out, "evict_first": evict}))
''')


def test_mma_block_product_gets_the_fragment_layout(tmp_path):
    """The inline-PTX mma.sync of kernels/mma_decode.py is only right if Triton gives each thread one
    row of the [DEPTH * NW * 32, 4] operand tensors (4 consecutive registers, one lane per row): the
    layout it picks for the PTX launches of the specs (a cover: every value each constexpr and num_warps takes),
    compiled as launched (16-byte divisibility); and
    their weight loads carry L2's evict-first hint exactly where the spec asks (mma_launch.weights_evict_first).
    (A scale load of one word broadcast over the 4 columns once made Triton pick a row-major
    [1, 1] layout for the small launches.)"""
    (tmp_path / "probe.py").write_text(FRAGMENT_PROBE)
    proc = _run([str(tmp_path / "probe.py")], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    out = probe["layouts"]
    assert out and all(out.values()), out
    # The same launches stream their weights with L2's evict-first policy where they ask for it, and only there.
    evict = probe["evict_first"]
    assert any(asked for asked, _ in evict.values()), evict
    assert all(asked == found for asked, found in evict.values()), evict
    for label, layouts in out.items():
        for layout in layouts:
            assert _one_row_per_lane(layout), (label, layout)


def _one_row_per_lane(layout: str) -> bool:
    """A [R, 4] layout giving each thread 4 consecutive registers of one row and consecutive lanes
    consecutive rows: as a blocked layout, or as the linear layout Triton picks for row halves of
    such a tensor (registers 0-3 = columns 0-3, lanes = rows 1, 2, 4, 8, 16)."""
    if layout.startswith("#ttg.blocked"):
        return "sizePerThread = [1, 4]" in layout and "threadsPerWarp = [32, 1]" in layout
    return ("register = [[0, 1], [0, 2]" in layout
            and "lane = [[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]]" in layout)
