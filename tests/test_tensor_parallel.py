"""Tensor parallelism on gloo, world sizes 2 and 4 (tests/tp_harness.py: spawned ranks, bounded in time).

The 4-layer ``tiny_tp`` model (2 dense + 2 sparse MoE; 8 heads, 2 kv heads: kv heads split at TP 2 and
replicated at TP 4; MXFP8 linears and MXFP4 experts, so scale and packed splits are exercised) is saved
once as a full checkpoint; every rank loads its shard from it (loader.load_model(tp_group=...)) and
runs three decode steps (q = 1, 1, 2, each with a padding request) three ways: the unfused vocabulary
eagerly (minimax.all_reduce between the halves), the fused ops eagerly, and torch.compile with the pass
(fused layers counted). The TP 1 reference is the same model unsharded, in one process: each rank's
logits must equal its logits at fp32 tolerance (the partial sums are fp32 and rounded once:
ops/chain.py), and each rank's caches must equal its shard of its caches; all ranks' logits must be
the same bits, and within bf16 tolerance of the fp32 oracle (reference_model, which rounds elsewhere).

The rank-divergence test gives one rank input the others do not get (a bad slot, checked mode through
the environment, a checked-mode disagreement) and asserts that every rank takes the same path.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tp_harness
from graph_passes import MiniMaxM3DecodePass, uncached_compiles
from minimax_ops import reference_model as rm
from minimax_ops.cache import LayerCache, allocate_caches, build_step, request_block_ids
from minimax_ops.config import preset
from minimax_ops.loader import load_model, save_checkpoint
from minimax_ops.model import MiniMaxM3ForCausalLM
from minimax_ops.ops import fused as fused_ops
from minimax_ops.sharding import kv_head_slice
from minimax_ops.weights import random_model_weights

CFG = preset("tiny_tp")
NUM_BLOCKS = 32
CONTEXTS = [37, 70]  # plus one padding request per step
QUERY_LENS = (1, 1, 2)
FP32_TOLERANCE = 1e-5  # per-token relative error of fp32 logits against TP 1
BF16_TOLERANCE = 1e-2  # against the oracle
DEADLINE_S = {2: 300, 4: 480}


def _prepare(workdir, seed: int = 0) -> None:
    """The full checkpoint, the initial caches, the steps and the TP 1 reference's logits and caches."""
    g = torch.Generator().manual_seed(seed)
    weights = random_model_weights(CFG, generator=g, linear_format="mxfp8", expert_format="mxfp4")
    save_checkpoint(weights, CFG, workdir / "ckpt")
    caches = allocate_caches(CFG, NUM_BLOCKS, generator=g)
    tp1 = MiniMaxM3ForCausalLM(CFG, weights)
    tp1_caches, ref_caches = [c.clone() for c in caches], [c.clone() for c in caches]
    steps, logits, oracle, blocks, ctx = [], [], [], None, list(CONTEXTS)
    for q in QUERY_LENS:
        meta = build_step(ctx, q, block_size=CFG.sparse_block_size, num_blocks=NUM_BLOCKS, pad_requests=1,
                          generator=g, block_ids=blocks)
        blocks, ctx = request_block_ids(meta, CFG.sparse_block_size), [c + q for c in ctx]
        ids = torch.randint(0, CFG.vocab_size, (meta.num_tokens,), generator=g)
        steps.append((ids, meta))
        logits.append(tp1(ids, meta.positions, tp1_caches, meta))
        oracle.append(rm.model_forward(ids, weights, ref_caches, meta, CFG))
    torch.save({"caches": caches, "steps": steps, "logits": logits, "oracle": oracle, "tp1_caches": tp1_caches},
               workdir / "case.pt")


def _shard(caches: list[LayerCache], rank: int, world: int) -> list[LayerCache]:
    """A rank's part of TP 1 caches: its kv heads of the main cache, the whole (replicated) index cache."""
    heads = kv_head_slice(CFG, rank, world)
    return [LayerCache(c.kv[:, heads].clone(), None if c.index is None else c.index.clone()) for c in caches]


def decode_worker(rank: int, world: int, workdir: str) -> dict:
    case = torch.load(f"{workdir}/case.pt", weights_only=False)
    group = dist.group.WORLD
    x = torch.randn(3, CFG.hidden_size, generator=torch.Generator().manual_seed(rank))
    torch.library.opcheck(torch.ops.minimax.all_reduce.default, (x, group.group_name))
    models = {name: load_model(f"{workdir}/ckpt", tp_group=group) for name in ("eager", "eager_fused", "compiled")}
    models["eager_fused"].use_fused_ops = True
    graph_pass = MiniMaxM3DecodePass(record=True)
    torch._dynamo.reset()
    run = dict(models, compiled=torch.compile(models["compiled"], fullgraph=True, dynamic=False,
                                              options={"post_grad_custom_post_pass": graph_pass}))
    out = {"logits": {}, "caches": {}, "fused_runs": {}}
    with uncached_compiles():
        for name, fn in run.items():
            caches = _shard(case["caches"], rank, world)
            out["logits"][name], out["fused_runs"][name] = [], []
            for ids, meta in case["steps"]:
                before = dict(fused_ops.impl_calls)
                out["logits"][name].append(fn(ids, meta.positions, caches, meta))
                out["fused_runs"][name].append({k: fused_ops.impl_calls[k] - before[k] for k in before})
            out["caches"][name] = caches
    out["graphs"], out["rewrites"] = len(graph_pass.graphs), graph_pass.rewrites
    out["all_reduces_after"] = [after.count("minimax.all_reduce") for _, after in graph_pass.graphs]
    out["all_reduces_before"] = [before.count("minimax.all_reduce") for before, _ in graph_pass.graphs]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_decode_equals_tp1(tmp_path, world):
    _prepare(tmp_path)
    case = torch.load(tmp_path / "case.pt", weights_only=False)
    ranks = tp_harness.unwrap(tp_harness.run_ranks(world, decode_worker, tmp_path, deadline_s=DEADLINE_S[world]))
    layers = CFG.num_hidden_layers
    for rank, r in enumerate(ranks):
        # One graph per query length; the pass fused every layer of each, and took both all-reduces in.
        assert r["graphs"] == 2 and r["rewrites"] == 2 * layers, (rank, r["graphs"], r["rewrites"])
        assert r["all_reduces_before"] == [2 * layers] * 2 and r["all_reduces_after"] == [0, 0]
        per_step = {"dense": 2, "sparse": 2}
        assert r["fused_runs"]["compiled"] == [per_step] * 3 and r["fused_runs"]["eager_fused"] == [per_step] * 3
        assert r["fused_runs"]["eager"] == [{"dense": 0, "sparse": 0}] * 3
        for name, logits in r["logits"].items():
            for step, (got, want, oracle, (_, meta)) in enumerate(zip(logits, case["logits"], case["oracle"],
                                                                      case["steps"])):
                real = meta.slot_mapping >= 0  # padding rows carry no meaning
                err = ((got - want).norm(dim=1) / want.norm(dim=1))[real]
                assert err.max() <= FP32_TOLERANCE, (rank, name, step, err.tolist())
                assert ((got - oracle)[real].norm() / oracle[real].norm()) <= BF16_TOLERANCE, (rank, name, step)
                assert torch.equal(got, ranks[0]["logits"][name][step]), f"rank {rank} {name} step {step} differs"
                assert torch.equal(got, r["logits"]["eager"][step]), f"rank {rank}: {name} differs from eager"
        want_caches = _shard(case["tp1_caches"], rank, world)
        for name, caches in r["caches"].items():
            for layer, (got, want) in enumerate(zip(caches, want_caches, strict=True)):
                assert torch.equal(got.kv, want.kv), f"rank {rank} {name} layer {layer} kv cache"
                assert (got.index is None) == (want.index is None)
                assert got.index is None or torch.equal(got.index, want.index), f"rank {rank} {name} layer {layer}"


# ---- under vLLM's tensor-parallel group ---------------------------------------------------------------------


def vllm_group_worker(rank: int, world: int, workdir: str) -> dict:
    """The model given the reserved group name "vllm:tp": its all-reduces go through vLLM's own
    GroupCoordinator (its CPU communicator here), built on the harness's gloo world."""
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    import minimax_vllm  # noqa: F401  (the decode pass reads the deployment from vLLM's config through it)
    from minimax_ops.ops.collectives import VLLM_TP_GROUP

    case = torch.load(f"{workdir}/case.pt", weights_only=False)
    # The pass reads the deployment from the current config: its cache block size must be the model's.
    config = VllmConfig(device_config=DeviceConfig(device="cpu"),
                        cache_config=CacheConfig(block_size=CFG.sparse_block_size))
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(world, rank, f"file://{workdir}/store", rank, backend="gloo")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        try:
            out = {"group_size": parallel_state.get_tp_group().world_size, "logits": {}}
            for name in ("eager_fused", "compiled"):
                model = MiniMaxM3ForCausalLM(CFG, _rank_weights(workdir, rank, world), tp_size=world,
                                             tp_group=VLLM_TP_GROUP)
                model.use_fused_ops = name == "eager_fused"
                graph_pass = MiniMaxM3DecodePass()
                torch._dynamo.reset()
                fn = model if name == "eager_fused" else torch.compile(
                    model, fullgraph=True, dynamic=False, options={"post_grad_custom_post_pass": graph_pass})
                caches = _shard(case["caches"], rank, world)
                out["logits"][name] = [fn(ids, meta.positions, caches, meta) for ids, meta in case["steps"][:2]]
                out["rewrites"] = graph_pass.rewrites
        finally:
            parallel_state.destroy_model_parallel()
    return out


def _rank_weights(workdir: str, rank: int, world: int):
    from minimax_ops.loader import load_weights

    return load_weights(f"{workdir}/ckpt", tp_rank=rank, tp_size=world)[1]


@pytest.mark.slow
def test_vllm_tp_group_serves_the_all_reduces(tmp_path):
    pytest.importorskip("vllm", reason="vLLM's tensor-parallel group needs vLLM")
    _prepare(tmp_path)
    case = torch.load(tmp_path / "case.pt", weights_only=False)
    ranks = tp_harness.unwrap(tp_harness.run_ranks(2, vllm_group_worker, tmp_path, deadline_s=300))
    for rank, r in enumerate(ranks):
        assert r["group_size"] == 2 and r["rewrites"] == CFG.num_hidden_layers
        for name, logits in r["logits"].items():
            for step, (got, want, (_, meta)) in enumerate(zip(logits, case["logits"], case["steps"])):
                real = meta.slot_mapping >= 0
                err = ((got - want).norm(dim=1) / want.norm(dim=1))[real]
                assert err.max() <= FP32_TOLERANCE, (rank, name, step, err.tolist())


# ---- rank-divergent input ---------------------------------------------------------------------------------


def _outcome(fn) -> tuple:
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the test compares what each rank did
        return (type(e).__name__, str(e))


def divergence_worker(rank: int, world: int, workdir: str) -> dict:
    import logging
    import os

    from minimax_ops.log import logger

    case = torch.load(f"{workdir}/case.pt", weights_only=False)
    group = dist.group.WORLD
    model = load_model(f"{workdir}/ckpt", tp_group=group)
    model.use_fused_ops = True
    ids, meta = case["steps"][0]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out = {}

    # A: rank 1's slot mapping points outside the cache. Rank 1's value check fails; rank 0's passes.
    caches = _shard(case["caches"], rank, world)
    bad = meta.slot_mapping.clone()
    if rank == 1:
        bad[0] = NUM_BLOCKS * CFG.sparse_block_size + 5
    bad_meta = type(meta)(**{**meta.__dict__, "slot_mapping": bad, "index_slot_mapping": bad.clone()})
    out["bad_slot"] = _outcome(lambda: model(ids, meta.positions, caches, bad_meta))
    out["bad_slot_caches_untouched"] = all(torch.equal(a.kv, b.kv) for a, b in zip(caches, _shard(case["caches"],
                                                                                               rank, world)))

    # B: checked mode through the environment on rank 0 only (a per-process setting).
    plain = model(ids, meta.positions, _shard(case["caches"], rank, world), meta)
    if rank == 0:
        os.environ["MINIMAX_OPS_CHECK"] = "1"
    env_checked = _outcome(lambda: model(ids, meta.positions, _shard(case["caches"], rank, world), meta))
    os.environ.pop("MINIMAX_OPS_CHECK", None)
    out["env_checked_same_as_plain"] = env_checked[0] == "ok" and torch.equal(env_checked[1], plain)
    out["env_checked"] = env_checked[0]

    # C: checked mode as the op argument (what the pass sets on every rank alike), layer 2 (sparse MoE).
    layer = model.model.layers[2]
    x = torch.randn(meta.num_tokens, CFG.hidden_size, generator=torch.Generator().manual_seed(7)).bfloat16()

    def checked_call(x_rank):
        c = _shard(case["caches"], rank, world)[2]
        return torch.ops.minimax.fused_decode_layer(
            x_rank, torch.zeros_like(x_rank), *layer._step(meta.positions, c, meta, False),
            *layer._weights().values(), *layer.consts(meta.query_len)[:-1], layer_index=2, checked=True,
            group_name=layer.group_name)[0]

    out["checked_agree"] = _outcome(lambda: checked_call(x))[0]
    nan_x = x.clone()
    if rank == 1:
        nan_x[1, 3] = float("nan")
    out["checked_nan"] = _outcome(lambda: checked_call(nan_x))
    if rank == 1:  # rank 1's fused FFN half returns a wrong residual (not reduced: rank 0's stays right)
        real = fused_ops.SPARSE_FFN_IMPL
        fused_ops.SPARSE_FFN_IMPL = lambda *a: (real(*a)[0], real(*a)[1] * 1.5)
    out["checked_disagree"] = _outcome(lambda: checked_call(x))
    out["log"] = [r.getMessage() for r in records]
    return out


@pytest.mark.slow
def test_rank_divergent_input_takes_the_same_path_on_every_rank(tmp_path):
    _prepare(tmp_path)
    r0, r1 = tp_harness.unwrap(tp_harness.run_ranks(2, divergence_worker, tmp_path, deadline_s=240))
    # A: both refuse before writing anything: rank 1 with its reason, rank 0 because rank 1 refused.
    assert r0["bad_slot"][0] == r1["bad_slot"][0] == "StepValueError", (r0["bad_slot"], r1["bad_slot"])
    assert "slot_mapping: expected slots in" in r1["bad_slot"][1]
    assert "another rank of tensor-parallel group" in r0["bad_slot"][1]
    assert r0["bad_slot_caches_untouched"] and r1["bad_slot_caches_untouched"]
    # B: the environment cannot split the ranks: rank 0 ignores it (and says so once), results unchanged.
    assert r0["env_checked_same_as_plain"] and r1["env_checked_same_as_plain"]
    assert sum("MINIMAX_OPS_CHECK is ignored under tensor parallelism" in m for m in r0["log"]) == 1
    # C: checked mode agrees: passes on both, and fails on both for NaN input or a disagreement on rank 1.
    assert r0["checked_agree"] == r1["checked_agree"] == "ok"
    assert r0["checked_nan"][0] == r1["checked_nan"][0] == "StepValueError"
    assert "NaN or Inf" in r1["checked_nan"][1] and "another rank" in r0["checked_nan"][1]
    assert r0["checked_disagree"][0] == r1["checked_disagree"][0] == "CheckedModeError"
    assert "token 0 residual: relative difference" in r1["checked_disagree"][1]
    assert "another rank" in r0["checked_disagree"][1]
