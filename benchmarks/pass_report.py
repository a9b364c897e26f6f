"""What the decode pass sees and does when a small model is compiled on a device: the post-grad graph's
vocabulary ops (auto_functionalized wrappers looked through) and the layers it rewrote. Compile caches are
off, so the pass runs: a reused compiled artifact (an earlier compile of the same graph) skips it.

    PYTHONPATH=$PWD python3 benchmarks/pass_report.py [--device cuda] [--preset tiny]
"""

from __future__ import annotations

import argparse
import collections
import logging

import torch

import minimax_ops  # noqa: F401  (registers the vocabulary)
from graph_passes import MiniMaxM3DecodePass, uncached_compiles
from graph_passes.decode_layer_patterns import PATTERNS
from graph_passes.fx_utils import op_of
from minimax_ops.cache import allocate_caches, build_step
from minimax_ops.config import preset
from minimax_ops.model import MiniMaxM3ForCausalLM
from minimax_ops.weights import random_model_weights


def graph_ops(graph: torch.fx.Graph) -> dict[str, int]:
    """Calls per op in a graph, the op a wrapper (auto_functionalized) carries counted as itself."""
    return dict(collections.Counter(str(op_of(n)) for n in graph.nodes if n.op == "call_function"))


class ReportingPass(MiniMaxM3DecodePass):
    """The decode pass, printing each graph's vocabulary ops and its rewrites as it runs."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        ops = {k: v for k, v in graph_ops(graph).items() if k.startswith("minimax.")}
        print(f"pass call {self.calls + 1}: vocabulary ops {ops}", flush=True)
        before = self.rewrites
        super().__call__(graph)
        print(f"pass call {self.calls}: {self.rewrites - before} layers rewritten", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("minimax_ops").setLevel(logging.INFO)  # refusal reasons
    dev, cfg = args.device, preset(args.preset)
    print(f"torch {torch.__version__}, {dev}; anchors {[str(p.insert_op) for p in PATTERNS]}", flush=True)
    g = torch.Generator().manual_seed(3)
    weights = random_model_weights(cfg, generator=g, device=dev, linear_format="mxfp8", expert_format="mxfp4")
    model = MiniMaxM3ForCausalLM(cfg, weights).to(dev)
    bs, prompts = cfg.sparse_block_size, [40, 23]
    blocks = sum(-(-(p + 1) // bs) for p in prompts) + 4
    fp8 = torch.float8_e4m3fn
    # The pass reads shapes and dtypes, not values: random caches and a decode step with no prefill before it.
    caches = allocate_caches(cfg, blocks, kv_dtype=fp8, index_dtype=fp8, device=dev, generator=g)
    meta = build_step(prompts, 1, block_size=bs, num_blocks=blocks, pad_requests=2, device=dev, generator=g,
                      table_width=blocks)
    tokens = torch.randint(0, cfg.vocab_size, (meta.num_tokens,), generator=g).to(dev)
    p = ReportingPass()
    compiled = torch.compile(model, fullgraph=True, options={"post_grad_custom_post_pass": p})
    with uncached_compiles():
        compiled(tokens, meta.positions, caches, meta)
    print(f"pass calls {p.calls}, layers rewritten {p.rewrites} of {cfg.num_hidden_layers}")


if __name__ == "__main__":
    main()
