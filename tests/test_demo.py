"""`python -m minimax_ops demo`: compiled + fused tiny model against the eager reference, on CPU."""

from __future__ import annotations

import re

import pytest
import torch

from minimax_ops import demo
from minimax_ops.__main__ import main

SAMPLE_GRAPH = """
    %add_rmsnorm : [num_users=2] = call_function[target=torch.ops.minimax.add_rmsnorm.default](args = (%x,))
    %auto_functionalized_v2 : [num_users=2] = call_function[target=torch.ops.higher_order.auto_functionalized_v2](args = (minimax.qk_norm_rope_kv_insert.default,), kwargs = {})
    %mx_linear_1 : [num_users=1] = call_function[target=torch.ops.minimax.mx_linear.default](args = (%minimax_ops_h,))
    %add_rmsnorm_1 : [num_users=2] = call_function[target=torch.ops.minimax.add_rmsnorm.default](args = (%y,))
"""


def test_op_counts_reads_direct_and_functionalized_calls():
    counts = demo.op_counts(SAMPLE_GRAPH)
    assert counts == {"add_rmsnorm": 2, "qk_norm_rope_kv_insert": 1, "mx_linear": 1}


@pytest.mark.slow
def test_demo_runs_and_fuses(capsys):
    threads = torch.get_num_threads()
    rc = main(["demo", "--steps", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "before -> after the pass" in out, out
    table = out.split("before -> after the pass:")[1]
    rows = {m.group(1): (int(m.group(2)), int(m.group(3)))
            for m in re.finditer(r"^\s+(\w+)\s+(\d+)\s+(\d+)$", table, re.MULTILINE)}
    cfg_layers = 3  # tiny preset: 1 dense + 2 sparse MoE
    assert rows["fused_decode_layer"] == (0, 2) and rows["fused_dense_decode_layer"] == (0, 1), table
    assert rows["moe_experts"][0] == 2 and rows["moe_experts"][1] == 0, table
    assert f"{cfg_layers} decode layer(s) fused of {cfg_layers}" in out
    steps = re.findall(r"step (\d): .*max rel error of logits (\S+) \(ok", out)
    assert [s for s, _ in steps] == ["0", "1"] and all(float(e) < demo.LOGITS_TOLERANCE for _, e in steps), out
    assert out.count("caches equal") == 2 or "differ by" in out
    assert "result: OK" in out
    assert torch.get_num_threads() == threads  # the demo restores the thread count it changed


def test_demo_fails_on_a_wrong_answer(capsys, monkeypatch):
    """A reference that disagrees must make the demo fail (exit 1); compile skipped to keep it quick."""
    real_forward = demo.model_forward

    def perturbed(*args, **kwargs):
        logits = real_forward(*args, **kwargs)
        return logits + 0.1 * logits.abs().mean() * torch.randn_like(logits)

    monkeypatch.setattr(demo, "model_forward", perturbed)
    monkeypatch.setattr(demo.torch, "compile", lambda model, **kwargs: model)
    rc = main(["demo", "--steps", "1", "--prompts", "20,9"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "FAIL," in out and "result: FAILED" in out


def test_bench_subcommand_is_dispatched(monkeypatch):
    import sys
    import types
    seen = {}
    fake = types.ModuleType("minimax_ops.bench")

    def fake_main(argv):
        seen["argv"] = argv
        return 0

    fake.main = fake_main
    monkeypatch.setitem(sys.modules, "minimax_ops.bench", fake)
    # `from . import bench` reads the package's attribute once the real module was imported (by an
    # earlier test): stand in there too, so the result does not depend on test order.
    import minimax_ops
    monkeypatch.setattr(minimax_ops, "bench", fake, raising=False)
    assert main(["bench", "--tokens", "1,2"]) == 0
    assert seen["argv"] == ["--tokens", "1,2"]


def test_bench_counts_the_bytes_of_the_routing_it_times():
    """bench.chain_bytes reads each chained layer's own expert and KV-block choices (one eager unfused
    run): a chain of two copies of one layer routes the second copy from the first one's output, and
    the bytes are the mean of step_bytes over those two routings."""
    import statistics
    from minimax_ops import bench
    from minimax_ops.cache import allocate_caches, build_step
    from minimax_ops.config import preset
    from minimax_ops.model import MiniMaxM3DecoderLayer
    from minimax_ops.weights import random_layer_weights
    cfg = preset("tiny")
    g = torch.Generator().manual_seed(5)
    w = random_layer_weights(cfg, 1, linear_format="mxfp8", expert_format="mxfp4", generator=g)
    layers = [MiniMaxM3DecoderLayer(cfg, w, 1), MiniMaxM3DecoderLayer(cfg, w, 1)]
    caches = allocate_caches(cfg, 16, kv_dtype=torch.float8_e4m3fn, index_dtype=torch.float8_e4m3fn, generator=g)
    caches = [caches[1], caches[1].clone()]
    meta = build_step([40, 9, 70], 1, block_size=cfg.sparse_block_size, num_blocks=16, generator=g)
    x = torch.randn(meta.num_tokens, cfg.hidden_size, generator=g).to(torch.bfloat16)
    res = torch.randn(meta.num_tokens, cfg.hidden_size, generator=g).to(torch.bfloat16)
    with bench._StepChoices() as seen:
        h, r = layers[0](x, res, meta.positions, caches[0], meta, True)
        layers[1](h, r, meta.positions, caches[1], meta, True)
    assert [tuple(i.shape) for i in seen.ids] == [(meta.num_tokens, cfg.num_experts_per_tok)] * 2
    assert len(seen.blocks) == 2
    want = statistics.mean(bench.step_bytes(layer, cache, meta, ids, blocks)
                           for layer, cache, ids, blocks in zip(layers, caches, seen.ids, seen.blocks))
    assert bench.chain_bytes(layers, caches, x, res, meta) == want
