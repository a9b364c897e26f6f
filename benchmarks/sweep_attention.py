"""Launch sweep of the latency-bound middle of a sparse layer: the indexer's score pass, its top-k, and the
sparse attention (split + merge), alone on one GPU at real size (fp8 KV + index caches).

    PYTHONPATH=$PWD python3 benchmarks/sweep_attention.py [--tokens 1,16] [--context 32768] [--copies 4] \
        [--parts scores,attention]

Each timed CUDA graph holds one call per cache copy (--copies layers' caches, so L2 never holds what a call
reads); the median replay over the copies is one call. Variants patch index_topk.SCORE_LAUNCH,
attention.SPLIT_LAUNCH and attention.MAX_TILE; every variant's output is checked against the first one's
(scores: equal where written; attention: 1e-2 relative). MB counts the index keys (score pass) or the
selected K / V rows (attention) a call must read.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from minimax_ops.bench import _time, copy_bandwidth, layer_caches
from minimax_ops.cache import build_step
from minimax_ops.config import preset
from minimax_ops.kernels import attention, index_topk

_BASE_SCORE = dict(index_topk.SCORE_LAUNCH)
_BASE_SPLIT = dict(attention.SPLIT_LAUNCH)
_BASE_TILE = attention.MAX_TILE


def _set(score: dict | None = None, split: dict | None = None, tile: int | None = None) -> None:
    index_topk.SCORE_LAUNCH.clear()
    index_topk.SCORE_LAUNCH.update(_BASE_SCORE, **(score or {}))
    attention.SPLIT_LAUNCH.clear()
    attention.SPLIT_LAUNCH.update(_BASE_SPLIT, **(split or {}))
    attention.MAX_TILE = tile or _BASE_TILE  # (128: whole blocks always; None: _tile's rule)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--parts", default="scores,attention", help="what to sweep: scores, attention or both")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    cfg = preset("real")
    bw = copy_bandwidth(device)
    tokens = [int(t) for t in args.tokens.split(",")]
    caches, blocks = layer_caches(cfg, args.copies, max(tokens), args.context, device)
    gen = torch.Generator().manual_seed(0)
    heads, kvh, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hi, di, topk = cfg.sparse_num_index_heads, cfg.sparse_index_dim, cfg.sparse_topk_blocks
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for n in tokens:
        meta = build_step([args.context - 1] * n, 1, block_size=cfg.sparse_block_size, num_blocks=blocks,
                          device=device, generator=gen)
        iq = torch.randn(n, hi, di, generator=gen).to(device, torch.bfloat16)
        q = torch.randn(n, heads, dim, generator=gen).to(device, torch.bfloat16)
        key_mb = n * args.context * di / 1e6
        kv_mb = n * kvh * topk * cfg.sparse_block_size * 2 * dim / 1e6

        def scores_all():
            return [index_topk.index_scores(iq, c.index, meta.block_table, meta.seq_lens, 1) for c in caches]

        def row(name, us, mb):
            print(f"n={n:3d} {name:48s} {us:8.2f} us  {mb:7.1f} MB  {mb / us:6.2f} TB/s "
                  f"{100 * mb * 1e6 / (us * 1e-6) / bw:5.1f}%", flush=True)

        _set()
        base_scores = scores_all()
        nb = -(-args.context // cfg.sparse_block_size)
        score_launches = itertools.product((2, 4, 8), (4, 8), (2, 3)) if "scores" in args.parts else ()
        for ppsm, warps, stages in score_launches:
            _set(score=dict(programs_per_sm=ppsm, num_warps=warps, num_stages=stages))
            try:
                got = scores_all()
                bad = any(not torch.allclose(a[..., :nb], b[..., :nb], rtol=1e-5, atol=1e-5)
                          for a, b in zip(got, base_scores))
                us = _time(scores_all, graph=True) / len(caches)
            except Exception as e:  # a config that does not compile: say so and go on
                print(f"n={n:3d} scores ppsm={ppsm} w={warps} st={stages}: {type(e).__name__} {e}"[:300])
                continue
            row(f"scores ppsm={ppsm} w={warps} st={stages}{' MISMATCH' if bad else ''}", us,
                key_mb)
        _set()
        ids = [index_topk.index_topk(iq, c.index, meta.block_table, meta.seq_lens, 1, topk) for c in caches]
        sc = base_scores

        def topk_all():
            out = torch.empty(n, hi, topk, dtype=torch.int32, device=device)
            for s in sc:
                index_topk._select_blocks(s, meta.seq_lens, out, 1, cfg.sparse_block_size)
        row("top-k kernel", _time(topk_all, graph=True) / len(caches), 0.0)

        def attn_ids():
            return [attention.sparse_attention_decode(q, c.kv, meta.block_table, meta.seq_lens, i, 1, 1.0, 1.0)
                    for c, i in zip(caches, ids)]

        def attn_select():
            return [attention.index_sparse_attention_decode(q, s, c.kv, meta.block_table, meta.seq_lens, 1, topk,
                                                            1.0, 1.0) for c, s in zip(caches, sc)]
        base_out = attn_ids()
        for kind, fn in (("ids", attn_ids), ("select", attn_select)) if "attention" in args.parts else ():
            for tile, ppsm, stages in itertools.product((None, 64, 128), (2, 4), (2, 3, 4)):
                _set(split=dict(sparse_per_sm=ppsm, num_stages=stages), tile=tile)
                try:
                    got = fn()
                    err = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                              for a, b in zip(got, base_out))
                    us = _time(fn, graph=True) / len(caches)
                except Exception as e:
                    print(f"n={n:3d} attn {kind} tile={tile}: {type(e).__name__} {e}"[:300])
                    continue
                row(f"attn {kind} tile={tile or 'rule'} ppsm={ppsm} st={stages}"
                    f"{' MISMATCH %.3g' % err if err > 1e-2 else ''}", us, kv_mb)
        _set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
