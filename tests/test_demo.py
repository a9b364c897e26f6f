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
    assert main(["bench", "--tokens", "1,2"]) == 0
    assert seen["argv"] == ["--tokens", "1,2"]
