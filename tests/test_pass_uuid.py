"""The decode pass's uuid() keys Inductor's and vLLM's compile caches: it must cover every source the
rewrite depends on, so that a changed schema, limit or pattern never serves a stale graph."""

from __future__ import annotations

import pathlib

from graph_passes import MiniMaxM3DecodePass
from graph_passes import fused_decode_pass as fdp

ROOT = pathlib.Path(__file__).parents[1]


def test_uuid_hashes_every_source_the_rewrite_reads():
    files = {p.relative_to(ROOT).as_posix() for p in fdp.source_files()}
    must = {"minimax_ops/ops/stages.py", "minimax_ops/ops/fused.py", "minimax_ops/ops/checks.py",
            "minimax_ops/constants.py", "minimax_ops/config.py", "minimax_ops/model.py", "minimax_vllm/deployment.py"}
    must |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "graph_passes").glob("*.py")}
    assert must <= files, sorted(must - files)


def test_uuid_changes_when_a_source_changes_and_only_then(monkeypatch, tmp_path):
    before = MiniMaxM3DecodePass().uuid()
    copy = tmp_path / "constants.py"
    real = fdp.source_files
    monkeypatch.setattr(fdp, "source_files",
                        lambda: [copy if p.name == "constants.py" and p.parent.name == "minimax_ops" else p
                                 for p in real()])
    source = (ROOT / "minimax_ops" / "constants.py").read_text()
    copy.write_text(source)  # the same text elsewhere: the same uuid
    assert MiniMaxM3DecodePass().uuid() == before
    copy.write_text(source + "\nMAX_TOKENS = 8\n")
    assert MiniMaxM3DecodePass().uuid() != before
