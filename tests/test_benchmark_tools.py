"""The GPU benchmark tools in benchmarks/ import on any machine (ab_fused imported a helper bench.py had
dropped, unnoticed until a device run), and their CPU-side pieces do what they say: A/B variant parsing,
the knobs that patch one GEMV's tiles and restore them, the stage-removal hooks."""

from __future__ import annotations

import importlib
import pathlib
import sys

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
TOOLS = ("ab_fused", "stage_removal", "sweep_mma_linear", "sweep_attention", "sweep_kernels", "read_patterns",
         "ring_stream", "gluon_ring_stream", "pass_report", "handoff_latency", "select_latency", "gemv_weight_copies",
         "profile_layer", "read_ceiling")
HELPERS = ("kernel_attributes", "sweep_kernels_jobs")  # imported by the tools, no main of their own


@pytest.fixture
def tools(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield lambda name: importlib.import_module(name)
    for name in TOOLS + HELPERS:
        sys.modules.pop(name, None)


@pytest.mark.parametrize("name", TOOLS)
def test_benchmark_scripts_import(tools, name):
    assert callable(tools(name).main)


def test_pass_report_counts_ops_through_wrappers(tools):
    """The report counts a mutating op wrapped in auto_functionalized as the op itself."""
    report = tools("pass_report")
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch.ops.higher_order.auto_functionalized_v2, (torch.ops.aten.add_.Tensor,), {})
    graph.call_function(torch.ops.aten.add.Tensor, (x, x))
    graph.call_function(torch.ops.aten.add.Tensor, (x, x))
    assert report.graph_ops(graph) == {"aten.add_.Tensor": 1, "aten.add.Tensor": 2}


def test_ab_variants_parse(tools):
    ab = tools("ab_fused")
    assert ab.parse_variants("base;q:QKV=8/1/6/96,X=1;") == [("base", {}), ("q", {"QKV": "8/1/6/96", "X": "1"})]


def test_ab_gemv_knobs_patch_one_gemv_and_restore(tools, monkeypatch):
    """QKV= replaces the qkv GEMV's tiles only (qkv_mma's), OPROJ= mx_linear's mma GEMV's only; both come
    back after the variant. (PTX forced on, as on the GPU the knobs apply to.)"""
    ab = tools("ab_fused")
    from minimax_ops.kernels import linear_mma, qkv_mma
    monkeypatch.setattr(linear_mma, "use_ptx", lambda device: True)
    cpu = torch.device("cpu")
    base_q = qkv_mma.linear_tiles(9856, 6144, cpu, True)
    base_o = linear_mma.linear_tiles(6144, 8192, cpu, True)
    with ab._Env({"QKV": "8/1/6/96"}):
        t, ptx = qkv_mma.linear_tiles(9856, 6144, cpu, True)
        assert ptx and (t.num_warps, t.depth, t.split, t.max_registers) == (8, 1, 6, 96)
        assert linear_mma.linear_tiles(6144, 8192, cpu, True) == base_o
    with ab._Env({"OPROJ": "8/2/4/128"}):
        t, _ = linear_mma.linear_tiles(6144, 8192, cpu, True)
        assert (t.depth, t.split, t.max_registers) == (2, 4, 128)
        assert qkv_mma.linear_tiles(9856, 6144, cpu, True) == base_q
    assert qkv_mma.linear_tiles(9856, 6144, cpu, True) == base_q
    assert linear_mma.linear_tiles(6144, 8192, cpu, True) == base_o


def test_ab_expert_knobs_patch_one_format_and_restore(tools):
    """W2= sets the mxfp4_mma expert tiles of every step size only (a sixth field the load steps held in
    registers, 2 without it), W13F8= the mxfp8_mma ones only; both come back after the variant."""
    ab = tools("ab_fused")
    from minimax_ops.kernels.tiles import mma_expert_tiles

    def tiles():
        return [mma_expert_tiles(k, w13, fp8=fp8, one_token=one) for k, w13 in ((6144, True), (3072, False))
                for fp8 in (False, True) for one in (False, True)]
    base = tiles()
    for w2, ring in (("1/2/2/96", 2), ("1/2/2/96/3", 3)):
        with ab._Env({"W2": w2, "W13F8": "1/0/3/64/0"}):
            now = tiles()
            for one in (0, 1):
                assert (now[4 + one].k_chunks, now[4 + one].num_stages, now[4 + one].split,
                        now[4 + one].max_registers, now[4 + one].ring) == (1, 3, 2, 96, ring)  # mxfp4 w2
                assert (now[2 + one].k_chunks, now[2 + one].split, now[2 + one].max_registers) == (1, 3, 64)  # mxfp8 w13
            assert now[:2] == base[:2] and now[6:] == base[6:]
        assert tiles() == base


def test_ab_warp_split_knob_moves_splits_to_the_grid_and_restores(tools):
    """WS=gemv+w13: o_proj's and the one-token w13's K splits made by the programs' warps, WS=0: all by
    the grid, WS=w13: w13's only; each for the variant only."""
    ab = tools("ab_fused")
    from minimax_ops.kernels.tiles import mma_expert_tiles, mma_linear_tiles

    def tiles():
        return mma_linear_tiles(6144, 8192, 132, True), mma_expert_tiles(6144, True, one_token=True)
    base = tiles()
    with ab._Env({"WS": "gemv+w13"}):
        warps = tiles()
        assert warps[0].warp_split > 1 and warps[1].warp_split > 1
    with ab._Env({"WS": "0"}):
        grid = tiles()
        for t, w in zip(grid, warps):
            assert t.warp_split == 1 and t.split == w.split * w.warp_split
    with ab._Env({"WS": "w13"}):
        assert tiles() == (grid[0], warps[1])
    assert tiles() == base


def test_fused_stage_times_from_a_timeline():
    """Each kernel adds the time from its predecessor's end to its own end to its stage; the first of a
    layer's two norms is the input norm; the first layer (no predecessor in the graph) is left out."""
    from minimax_ops.timeline import layer_stage_times, stage_of
    names = ["_rmsnorm_kernel", "_qkv_norm_rope_insert_kernel", "_index_score_kernel", "_attention_split_kernel",
             "_attention_merge_kernel", "_mma_linear_kernel", "_rmsnorm_kernel", "_router_logits_kernel",
             "_mma_w13_kernel", "_mma_w2_kernel", "_moe_combine_kernel"]
    ends = [2.0, 20.0, 23.0, 29.0, 31.0, 46.0, 48.0, 53.0, 86.0, 102.0, 104.0]
    run = [(n, e - 1.5, e) for n, e in zip(names, ends)] + [(n, e + 103.5, e + 105.0) for n, e in zip(names, ends)]
    (times,) = layer_stage_times(run, 2)
    assert times["input norm"] == pytest.approx(3.0)  # 107 - 104
    assert times["qkv + qk norm / RoPE / insert"] == pytest.approx(18.0)
    assert times["index + top-k + attention"] == pytest.approx(11.0)
    assert times["o_proj"] == pytest.approx(15.0)
    assert times["post-attention norm"] == pytest.approx(2.0)
    assert times["router"] == pytest.approx(5.0)
    assert times["experts"] == pytest.approx(51.0)
    assert times["layer"] == pytest.approx(105.0) == pytest.approx(sum(v for k, v in times.items() if k != "layer"))
    assert stage_of("_slot_table_kernel") == "experts" and stage_of("some_other_kernel") == "some_other_kernel"
    with pytest.raises(ValueError, match="do not split into 3 layers"):
        layer_stage_times(run, 3)
    # Steps whose qkv GEMV and qk norm / RoPE / insert are two kernels (qkv_mma.ONE_KERNEL_TOKENS): the GEMV
    # before the attention kernels counts in the qkv stage, the one after them is o_proj.
    names[1:2] = ["_mma_linear_kernel", "_qk_norm_rope_insert_kernel"]
    ends[1:2] = [17.0, 20.0]
    run = [(n, e - 1.5, e) for n, e in zip(names, ends)] + [(n, e + 103.5, e + 105.0) for n, e in zip(names, ends)]
    (times,) = layer_stage_times(run, 2)
    assert times["qkv + qk norm / RoPE / insert"] == pytest.approx(18.0)
    assert times["o_proj"] == pytest.approx(15.0)
    assert times["layer"] == pytest.approx(105.0)


def test_ab_attention_knob_patches_split_launch_and_restores(tools):
    """ATTN= sets the sparse attention split kernel's programs per SM and stages for the variant only."""
    ab = tools("ab_fused")
    from minimax_ops.kernels import attention
    base = dict(attention.SPLIT_LAUNCH)
    with ab._Env({"ATTN": "3/4"}):
        assert attention.SPLIT_LAUNCH == {**base, "sparse_per_sm": 3, "num_stages": 4}
    assert attention.SPLIT_LAUNCH == base


def test_ab_score_knob_patches_score_launch_and_restores(tools):
    """SCORE= sets the indexer's score pass programs per SM, warps and stages for the variant only."""
    ab = tools("ab_fused")
    from minimax_ops.kernels import index_topk
    base = dict(index_topk.SCORE_LAUNCH)
    with ab._Env({"SCORE": "3/8/1"}):
        assert index_topk.SCORE_LAUNCH == {**base, "programs_per_sm": 3, "num_warps": 8, "num_stages": 1}
    assert index_topk.SCORE_LAUNCH == base


def test_ab_carveout_knob_loads_the_kernels_first_and_restores(tools, monkeypatch):
    """CARVE= runs the variant's warm call (so its kernels are loaded), then sets every package kernel's
    carveout preference; the driver's choice (-1) comes back after the variant; no CARVE, no call."""
    ab = tools("ab_fused")
    calls = []
    monkeypatch.setattr(ab.kernel_attributes, "set_carveout", calls.append)
    with ab._Env({"CARVE": "100"}, warm=lambda: calls.append("warm")):
        assert calls == ["warm", 100]
    assert calls == ["warm", 100, -1]
    with ab._Env({"QKV1": "1"}, warm=lambda: calls.append("warm")):
        pass
    assert calls == ["warm", 100, -1]


def test_ab_short_knob_patches_topk_width_and_restores(tools):
    """SHORT= sets the indexer top-k's one-slice width (rows of more blocks go by groups) for the variant only."""
    ab = tools("ab_fused")
    from minimax_ops.kernels import index_topk
    base = index_topk.TOPK_CHUNK
    with ab._Env({"SHORT": "1024"}):
        assert index_topk.topk_widths(1024, 16) == (1024, 1024)
    assert index_topk.TOPK_CHUNK == base and index_topk.topk_widths(1024, 16) == (base, 1024)


def test_stage_removal_hooks(tools, monkeypatch):
    """Each hook passes through unless its stage is removed: a removed norm returns its input, a removed
    router (or the router's logits) its first call's result for that gate."""
    sr = tools("stage_removal")
    normed = []
    monkeypatch.setattr(sr, "_INPUT_NORM", lambda x, r, w, eps: normed.append(("input", eps)) or ("normed", r))
    monkeypatch.setattr(sr, "_POST_NORM", lambda x, r, w, eps: normed.append(("post", eps)) or ("normed", r))
    monkeypatch.setitem(sr._STATE, "remove", {"post"})
    assert sr._input_norm("x", "r", None, 1) == ("normed", "r")
    assert sr._post_norm("o", "r", None, 2) == ("o", "r")
    monkeypatch.setitem(sr._STATE, "remove", {"input"})
    assert sr._input_norm("x", "r", None, 3) == ("x", "r")
    assert sr._post_norm("o", "r", None, 4) == ("normed", "r")
    assert normed == [("input", 1), ("post", 4)]
    routed = []
    monkeypatch.setattr(sr, "_ROUTE", lambda h, gate, *a: routed.append(h) or (h, gate))
    monkeypatch.setattr(sr, "_LOGITS", lambda h, gate, **kw: routed.append(h) or h)
    monkeypatch.setitem(sr._STATE, "remove", {"route", "logits"})
    monkeypatch.setitem(sr._STATE, "route", {})
    monkeypatch.setitem(sr._STATE, "logits", {})
    gate = torch.zeros(2)
    assert sr._route("h1", gate, None, 4, 2.0) == ("h1", gate)
    assert sr._route("h2", gate, None, 4, 2.0) == ("h1", gate)
    assert sr._router_logits("l1", gate, pdl=True) == "l1"
    assert sr._router_logits("l2", gate, pdl=True) == "l1"
    monkeypatch.setitem(sr._STATE, "remove", set())
    assert sr._router_logits("l3", gate, pdl=True) == "l3"
    assert routed == ["h1", "l1", "l3"]


def test_stage_removal_score_pass_keeps_its_first_scores(tools, monkeypatch):
    """A removed score pass returns the first call's scores for that index cache (the attention's selection
    then reads real scores, not a buffer nothing wrote); the layer's stages take the input norm's hook."""
    sr = tools("stage_removal")
    from types import SimpleNamespace
    scored = []
    monkeypatch.setattr(sr, "_SCORES", lambda index_q, cache, *a, **kw: scored.append(index_q) or index_q)
    monkeypatch.setitem(sr._STATE, "score", {})
    cache = torch.zeros(2)
    monkeypatch.setitem(sr._STATE, "remove", {"score"})
    assert sr._index_scores("s1", cache, pdl=True) == "s1" and sr._index_scores("s2", cache, pdl=True) == "s1"
    monkeypatch.setitem(sr._STATE, "remove", set())
    assert sr._index_scores("s3", cache, pdl=True) == "s3" and scored == ["s1", "s3"]
    monkeypatch.setattr(sr, "_STAGES", lambda: SimpleNamespace(index_sparse_attention=None))
    assert sr._stages().input_add_rmsnorm is sr._input_norm


def test_stage_removal_skips_only_the_named_kernel(tools, monkeypatch):
    """A removed router top-k, attention merge or expert combine: the first call runs whole and its output is
    kept; later calls still run, with that one kernel's launches skipped (and restored after)."""
    sr = tools("stage_removal")
    from minimax_ops.kernels import attention
    launched = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: launched.append(grid)

    monkeypatch.setattr(attention, "_attention_merge_kernel", Kernel())
    monkeypatch.setitem(sr._STATE, "merge", {})

    def run(x):
        attention._attention_merge_kernel[(x,)]()
        return x

    assert sr._first_full("merge", 7, run, 1) == 1 and launched == [(1,)]
    assert sr._first_full("merge", 7, run, 2) == 1 and launched == [(1,)]
    assert isinstance(attention._attention_merge_kernel, Kernel)
    # The expert combine, through the experts' hook (keyed by the gate): the experts run, the combine not.
    from minimax_ops.kernels import moe_combine
    monkeypatch.setattr(moe_combine, "_moe_combine_kernel", Kernel())
    monkeypatch.setitem(sr._STATE, "combine", {})
    monkeypatch.setitem(sr._STATE, "remove", {"combine"})
    experts = []

    def routed(h, gate, *args, **kwargs):
        experts.append(h)
        moe_combine._moe_combine_kernel[(h,)]()
        return h

    monkeypatch.setattr(sr, "_ROUTED", routed)
    gate = torch.zeros(2)
    assert sr._routed_moe_experts(3, gate, pdl=True) == 3 and sr._routed_moe_experts(4, gate, pdl=True) == 3
    assert experts == [3, 4] and launched == [(1,), (3,)]
    assert isinstance(moe_combine._moe_combine_kernel, Kernel)


def test_gluon_ring_stream_lays_a_programs_step_in_one_box(tools):
    """The Gluon ring's step-major layout: block (program, warp, stream, step, d) of ring_stream's warp-major
    buffers lands at row ((program, step), stream, d, warp), so one program's step is the one contiguous box of
    rows its TMA descriptors read (words and scale bytes alike)."""
    g = tools("gluon_ring_stream")
    programs, n_steps = 2, 3
    blocks = programs * g.WARPS * 2 * n_steps * g.BLOCKS
    w = torch.randint(-2**31, 2**31 - 1, (blocks * 128,), dtype=torch.int32)
    s = torch.randint(0, 256, (blocks * 32,), dtype=torch.uint8)
    words, scales = g.step_major(w, s, programs, n_steps)
    box = 2 * g.BLOCKS * g.WARPS
    assert words.shape == (blocks, 128) and scales.shape == (blocks, 32)
    for p in range(programs):
        for k in range(n_steps):
            for st in range(2):
                for d in range(g.BLOCKS):
                    for warp in range(g.WARPS):
                        src = (((p * g.WARPS + warp) * 2 + st) * n_steps + k) * g.BLOCKS + d
                        row = (p * n_steps + k) * box + (st * g.BLOCKS + d) * g.WARPS + warp
                        assert torch.equal(words[row], w[src * 128:(src + 1) * 128])
                        assert torch.equal(scales[row], s[src * 32:(src + 1) * 32])
    descs = g.descriptors(words, scales, torch.zeros(n_steps, 2 * 32, dtype=torch.int32))
    assert [d.block_shape for d in descs] == [[box, 128], [box, 32], [1, 64]]


def test_profile_layer_report_splits_samples_at_the_wait_and_loads(tools):
    """The ncu source-page reader: each kernel's instructions and samples (columns found by name), the share sampled
    before the PDL wait and the cumulative shares at the global loads / stores after it; --kernel keeps one name."""
    prof = tools("profile_layer")
    head = '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","x"\n'

    def kernel(name, rows):
        return f'"Kernel Name","{name}",\n' + head + "".join(f'"0x{i:x}","      {t}","{s}","0","1"\n'
                                                              for i, (t, s) in enumerate(rows))
    split = [("LDC R1, c[0x0][0x28]", 3), ("ACQBULK", 1), ("IMAD R2, R0, R0, RZ", 0), ("LDG.E R4, [R2.64]", 2),
             ("FADD R5, R4, R4", 10), ("REDUX.MAX.S32 UR9, R5", 0), ("@P0  STG.E [R2.64], R5", 4)]
    text = kernel("_split", split) + kernel("_merge", [("LDG.E R1, [R2.64]", 5), ("EXIT", 5)]) + kernel("_split", split)
    kernels = prof.read_kernels(text)
    assert [k for k, _ in kernels] == ["_split", "_merge", "_split"]
    assert kernels[0][1][4] == ("FADD R5, R4, R4", 10)
    total, before, marks = prof.phases(kernels[0][1])
    assert total == 20 and before == pytest.approx(4 / 20)
    assert [(i, round(share, 2)) for i, share, _ in marks] == [(3, 0.3), (6, 1.0)]  # the predicated store, no REDUX
    assert prof.phases(kernels[1][1])[1] is None  # no wait: marks from the start
    out = prof.report(text)
    assert out.count("_split:") == 1 and "20% before the PDL wait" in out and "no PDL wait" in out
    one = prof.report(text, kernel="_split", top=1, every=True)
    assert one.count("_split:") == 2 and "_merge" not in one and one.count("50.0%  FADD") == 2


@pytest.mark.parametrize("step_major", [False, True])
def test_read_patterns_kernel_reads_every_word_once(tools, step_major):
    """Both layouts of the pure-read benchmark cover the buffer exactly once: the XOR of what the
    programs fold equals the XOR of the whole buffer (a word read twice or missed would change it)."""
    rp = tools("read_patterns")
    warps_per_program, programs, steps, depth = 4, 3, 3, 2
    warps = warps_per_program * programs
    half = warps * steps * depth * rp.WORDS
    torch.manual_seed(0)
    src = torch.randint(0, 2**31 - 1, (2 * half,), dtype=torch.int32)
    out = torch.zeros(programs * warps_per_program * 32 * 4, dtype=torch.int32)
    rp._read_kernel[(programs,)](src, out, warps, steps, half, STEP_MAJOR=step_major, DEPTH=depth,
                                 NW=warps_per_program)

    def xor_all(t):
        v = t.clone()
        while v.numel() > 1:
            if v.numel() % 2:
                v = torch.cat([v, torch.zeros(1, dtype=v.dtype)])
            v = v[0::2] ^ v[1::2]
        return int(v[0])
    assert xor_all(out) == xor_all(src)
    assert xor_all(out[: out.numel() // 2]) != 0  # (the fold is not trivially empty)


@pytest.mark.parametrize("contig", [True, False])
def test_read_ceiling_kernel_reads_every_tile_once(tools, contig):
    """Both orders of the read-ceiling kernel fold every tile of the buffer exactly once, with a tile
    count the programs do not divide (a tile read twice or missed would change the XOR)."""
    rc = tools("read_ceiling")
    tile, programs, n_tiles = 1024, 5, 23
    torch.manual_seed(0)
    src = torch.randint(-2**31, 2**31 - 1, (n_tiles * tile,), dtype=torch.int32)
    out = torch.zeros(programs * tile, dtype=torch.int32)
    rc._read_kernel[(programs,)](src, out, n_tiles, -(-n_tiles // programs), TILE=tile, CONTIG=contig, MODE=0)

    def fold(rows):
        acc = torch.zeros(tile, dtype=torch.int32)
        for r in rows:
            acc ^= r
        return acc
    assert torch.equal(fold(out.view(programs, tile)), fold(src.view(n_tiles, tile)))
    assert fold(out.view(programs, tile)[:2]).any()  # (the fold is not trivially empty)


def test_kernel_attributes_reach_every_loaded_kernel(tools, monkeypatch):
    """set_carveout asks the driver once per loaded specialisation of every package kernel (handles loaded first
    where a kernel was compiled but not yet launched), and report() prints the driver's registers, shared memory
    (static + Triton's dynamic) and programs an SM (driver calls faked: no GPU here)."""
    import ctypes
    from types import SimpleNamespace

    ka = tools("kernel_attributes")

    class Compiled:
        def __init__(self, handle, loaded):
            self.function = handle if loaded else None
            self.handle = handle
            self.metadata = SimpleNamespace(num_warps=8, shared=1024)
            self.n_spills = 0

        def _init_handles(self):
            self.function = self.handle

    kernels = {"a": SimpleNamespace(device_caches={0: ({"k1": Compiled(11, True), "k2": Compiled(12, False)},)}),
               "b": SimpleNamespace(device_caches={})}
    monkeypatch.setattr(ka.aot_check, "module_names", lambda: ["norm"])
    monkeypatch.setattr(ka.aot_check, "jit_functions", lambda module: kernels)
    calls = []

    class Driver:
        def cuFuncSetAttribute(self, handle, attribute, value):
            calls.append((handle.value, attribute, value.value))
            return 0

        def cuFuncGetAttribute(self, out, attribute, handle):
            ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = {1: 256, 4: 80}[attribute]
            return 0

        def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, out, handle, threads, shared):
            ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = 3 if threads == 256 else 0
            return 0

    monkeypatch.setattr(ka, "_cuda", Driver)
    assert ka.set_carveout(100) == 2
    assert calls == [(11, 9, 100), (12, 9, 100)]
    lines = ka.report()
    assert len(lines) == 2 and all("regs  80" in ln and "smem   1280" in ln and "->  3 a SM" in ln for ln in lines)
