"""MiniMaxM3ForCausalLM under torch.compile(fullgraph=True) on CPU.

One compiled model (module-scoped: each CPU compile costs 10-25 s) runs a prefill of two requests
(plus a padding request), two decode steps with q = 1 and one with q = 2 (each with a padding
request); an eager copy of the module and reference_model.model_forward run the same steps on their
own copies of the caches. A recording post-grad pass keeps every graph Inductor compiles, so the
tests can read the stage-op chain of each layer in the decode graphs and attention_any_step in the
prefill graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

from graph_passes import uncached_compiles
from minimax_ops import reference_model as rm
from minimax_ops.cache import allocate_caches, build_step, request_block_ids
from minimax_ops.config import SPARSE_MOE, preset
from minimax_ops.model import MiniMaxM3ForCausalLM
from minimax_ops.weights import random_model_weights
from utils import rel_err

CFG = preset("tiny")  # layer 0 dense, layers 1-2 sparse MoE; 16-token blocks, top-4 blocks
BS, NUM_BLOCKS = CFG.sparse_block_size, 32
AF = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
SPARSE_CHAIN = ("add_rmsnorm", "mx_linear", "qk_norm_rope_kv_index_insert", "index_topk", "sparse_attention_decode",
                "mx_linear", "add_rmsnorm", "route", "moe_experts")
DENSE_CHAIN = ("add_rmsnorm", "mx_linear", "qk_norm_rope_kv_insert", "dense_attention_decode", "mx_linear",
               "add_rmsnorm", "mlp")
DECODE_ONLY = {"index_topk", "sparse_attention_decode", "dense_attention_decode"}
# Two requests of 37 and 70 tokens: 3 and 5 blocks, so top-4 leaves blocks out of request 1's attention.
# Their decode steps stay within those blocks (same table width: no shape change between q=1 steps).
PREFILL_LENS = [37, 70]


def _minimax_op(node: Node) -> str | None:
    """Name of the torch.ops.minimax op a post-grad node calls, through auto_functionalized wrappers."""
    if node.op != "call_function":
        return None
    target = node.args[0] if node.target in AF else node.target
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "minimax":
        return target._opname
    return None


def _producer(value) -> Node | None:
    """The op node a value comes from, looking through getitem on multi-output ops."""
    while isinstance(value, Node) and value.target is operator.getitem:
        value = value.args[0]
    return value if isinstance(value, Node) else None


def _op_inputs(node: Node) -> list[Node]:
    values = list(node.args[1:] if node.target in AF else node.args) + list(node.kwargs.values())
    flat = []
    for v in values:
        flat.extend(v if isinstance(v, (list, tuple)) else [v])
    return [p for p in map(_producer, flat) if p is not None]


def _query_len_arg(node: Node):
    """A decode op's query_len: an int constant, or ('sym', value) when Dynamo made it a SymInt."""
    if node.target in AF:
        return None
    names = [a.name for a in node.target._schema.arguments]
    if "query_len" not in names:
        return None
    value = node.args[names.index("query_len")]
    return ("sym", str(value.meta.get("val"))) if isinstance(value, Node) else value


class RecordingPass(CustomGraphPass):
    """Post-grad pass that changes nothing and records each graph: its text and its minimax op nodes
    (name, inputs' producer indices), read at pass time before Inductor lowers the graph."""

    def __init__(self):
        self.graphs: list[dict] = []

    def __call__(self, graph: Graph) -> None:
        ops = [n for n in graph.nodes if _minimax_op(n)]
        index = {n: i for i, n in enumerate(ops)}
        self.graphs.append({
            "text": str(graph),
            "ops": [_minimax_op(n) for n in ops],
            "inputs": [{index[p] for p in _op_inputs(n) if p in index} for n in ops],
            "query_len": [_query_len_arg(n) for n in ops],
        })

    def uuid(self) -> str:
        return "minimax-ops-test-recording-pass"


@dataclass
class Run:
    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    caches: dict[str, list] = field(default_factory=dict)
    steps: list[tuple[str, int]] = field(default_factory=list)  # (kind, graphs recorded after the step)
    metas: list = field(default_factory=list)
    recorder: RecordingPass | None = None


def _steps(gen):
    """(input_ids, meta) of: prefill of 2 requests + a padding request; decode q=1; decode q=1; decode q=2
    (each decode with a padding request)."""
    prefill = build_step([0, 0], PREFILL_LENS, block_size=BS, num_blocks=NUM_BLOCKS, pad_requests=1,
                         generator=gen)
    out = [("prefill", prefill)]
    blocks, ctx = request_block_ids(prefill, BS), list(PREFILL_LENS)
    for q in (1, 1, 2):
        meta = build_step(ctx, q, block_size=BS, num_blocks=NUM_BLOCKS, pad_requests=1, generator=gen,
                          block_ids=blocks)
        out.append((f"decode-q{q}", meta))
        ctx = [c + q for c in ctx]
    return [(kind, torch.randint(0, CFG.vocab_size, (m.num_tokens,), generator=gen), m) for kind, m in out]


@pytest.fixture(scope="module")
def run() -> Run:
    gen = torch.Generator().manual_seed(0)
    weights = random_model_weights(CFG, generator=gen, linear_format="mxfp8", expert_format="mxfp4")
    caches = allocate_caches(CFG, NUM_BLOCKS, kv_dtype=torch.float8_e4m3fn, generator=gen)
    model = MiniMaxM3ForCausalLM(CFG, weights)
    result = Run(recorder=RecordingPass())
    result.caches = {name: [c.clone() for c in caches] for name in ("eager", "compiled", "reference")}
    result.outputs = {name: [] for name in result.caches}
    compiled = torch.compile(model, fullgraph=True, options={"post_grad_custom_post_pass": result.recorder})
    run_path = {
        "eager": lambda ids, m, c: model(ids, m.positions, c, m),
        "compiled": lambda ids, m, c: compiled(ids, m.positions, c, m),
        "reference": lambda ids, m, c: rm.model_forward(ids, weights, c, m, CFG),
    }
    torch._dynamo.reset()
    with uncached_compiles():  # a cached artifact would skip the recording pass
        for kind, ids, meta in _steps(gen):
            for name, fn in run_path.items():
                result.outputs[name].append(fn(ids, meta, result.caches[name]))
            result.steps.append((kind, len(result.recorder.graphs)))
            result.metas.append(meta)
    return result


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


STEPS = ["prefill", "decode-q1", "decode-q1-again", "decode-q2"]


@pytest.mark.parametrize("step", range(len(STEPS)), ids=STEPS)
def test_compiled_equals_eager_equals_reference(run, step):
    eager, compiled, reference = (run.outputs[k][step] for k in ("eager", "compiled", "reference"))
    meta = run.metas[step]
    assert compiled.shape == (meta.num_tokens, CFG.vocab_size) and compiled.dtype == torch.float32
    assert torch.isfinite(compiled).all()
    # Same custom ops on the same inputs: Inductor only schedules them, so the logits agree bit for bit.
    assert torch.equal(compiled, eager)
    real = meta.slot_mapping >= 0  # padding rows carry no meaning
    assert rel_err(eager[real], reference[real]) < 1e-2
    assert not real.all(), "every step has padding rows"


def test_caches_are_byte_equal_across_paths(run):
    for layer in range(CFG.num_hidden_layers):
        eager, compiled, reference = (run.caches[k][layer] for k in ("eager", "compiled", "reference"))
        for part in ("kv", "index"):
            e, c, r = (getattr(x, part) for x in (eager, compiled, reference))
            if CFG.layer_kind(layer) != SPARSE_MOE and part == "index":
                assert e is None and c is None and r is None
                continue
            assert torch.equal(_bits(c), _bits(e)), f"layer {layer} {part}: compiled vs eager"
            assert torch.equal(_bits(e), _bits(r)), f"layer {layer} {part}: eager vs reference"


def test_compiled_steps_reuse_graphs(run):
    """One graph for the prefill, one per decode query length: the second q=1 step reuses the first's."""
    counts = [n for _, n in run.steps]
    assert counts == [1, 2, 2, 3], counts


def _graph_after(run, step: int) -> dict:
    return run.recorder.graphs[run.steps[step][1] - 1]


def _check_chains(graph: dict) -> None:
    ops, inputs = graph["ops"], graph["inputs"]
    expected, starts = [], []
    for layer in range(CFG.num_hidden_layers):
        starts.append(len(expected))
        expected += SPARSE_CHAIN if CFG.layer_kind(layer) == SPARSE_MOE else DENSE_CHAIN
    expected += ["add_rmsnorm", "mx_linear"]  # final norm + lm_head
    assert ops == expected, graph["text"]
    # Each stage consumes its predecessor's output (through getitem on multi-output ops), so the ops are
    # one chain per layer, and each layer starts from the previous layer's FFN output.
    for i in range(1, len(ops)):
        assert i - 1 in inputs[i], f"op {i} ({ops[i]}) does not consume op {i - 1} ({ops[i - 1]})"
    for layer, start in enumerate(starts):
        chain = SPARSE_CHAIN if CFG.layer_kind(layer) == SPARSE_MOE else DENSE_CHAIN
        post_norm = start + chain.index("add_rmsnorm", 1)
        assert start in inputs[post_norm], f"layer {layer}: post-attention norm misses the residual stream"
        if chain is SPARSE_CHAIN:
            assert start + 2 in inputs[start + 4], f"layer {layer}: sparse attention misses the written kv cache"


@pytest.mark.parametrize("step", [1, 3], ids=["decode-q1", "decode-q2"])
def test_decode_graph_has_the_stage_chain_per_layer(run, step):
    graph = _graph_after(run, step)
    _check_chains(graph)
    assert "attention_any_step" not in graph["ops"]
    # The step's query length reaches the decode ops: as the constant 1 for q = 1 (Dynamo specialises
    # 0 and 1), as a SymInt for q = 2 (automatic dynamic: query_len changed between compiled calls, so
    # the recompiled graph serves any q that passes its guards; the kernels still get a plain int).
    q = run.metas[step].query_len
    got = {(op, arg) for op, arg in zip(graph["ops"], graph["query_len"]) if op in DECODE_ONLY}
    assert {op for op, _ in got} == DECODE_ONLY
    args = {arg for _, arg in got}
    assert len(args) == 1, got  # one query length for every decode op of the step
    arg = args.pop()
    assert arg == 1 if q == 1 else (arg == q or arg[0] == "sym"), arg


def test_prefill_graph_uses_attention_any_step(run):
    graph = _graph_after(run, 0)
    ops = graph["ops"]
    assert ops.count("attention_any_step") == CFG.num_hidden_layers
    assert not DECODE_ONLY & set(ops)
    per_layer = [op for op in ops if op in ("qk_norm_rope_kv_insert", "qk_norm_rope_kv_index_insert",
                                             "attention_any_step")]
    expected = []
    for layer in range(CFG.num_hidden_layers):
        sparse = CFG.layer_kind(layer) == SPARSE_MOE
        expected += ["qk_norm_rope_kv_index_insert" if sparse else "qk_norm_rope_kv_insert", "attention_any_step"]
    assert per_layer == expected
    assert ops.count("route") == ops.count("moe_experts") == sum(k == SPARSE_MOE for k in CFG.layer_kinds)
