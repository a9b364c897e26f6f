"""Checked mode: MINIMAX_OPS_CHECK=1, or the graph pass's ``checked=True`` (the fused ops' ``checked``
argument), makes every fused layer step also run the unfused stage chain on the same inputs.

What is asserted: per layer and token, a line of max abs / max rel difference of ``out`` and
``residual`` goes to the ``minimax_ops`` logger; results and cache bytes equal an unchecked run (the
caches are written once, by the fused path; the unfused one writes clones); a fused implementation
that disagrees past MINIMAX_OPS_CHECK_TOL raises CheckedModeError naming the layer, token and tensor,
one below the tolerance passes, and one that writes a different cache byte raises about that cache.
Eagerly (layer.fused_forward, model.use_fused_ops) and compiled with MiniMaxM3DecodePass(checked=True).
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

import graph_text as gt
from graph_passes import MiniMaxM3DecodePass
from minimax_ops.cache import allocate_caches, build_step
from minimax_ops.config import SPARSE_MOE, preset
from minimax_ops.model import MiniMaxM3DecoderLayer, MiniMaxM3ForCausalLM
from minimax_ops.ops import chain
from minimax_ops.ops import fused as fused_ops
from minimax_ops.ops.checked import CheckedModeError
from minimax_ops.ops.chain import DENSE_WEIGHTS, SPARSE_WEIGHTS
from minimax_ops.reference_model import model_forward
from minimax_ops.weights import random_layer_weights

minimax = torch.ops.minimax
CFG = preset("tiny")  # layer 0 dense, layers 1-2 sparse MoE
DENSE, SPARSE = 0, 1
NUM_BLOCKS = 24
CONTEXTS, QUERY_LEN = [37, 70], 2  # plus one padding request: 6 tokens, the last 2 padding
FUSED_OPS = ("minimax.fused_dense_decode_layer", "minimax.fused_decode_layer")
LINE = re.compile(r"checked layer (?P<layer>-?\d+) \((?P<kind>\w+)\) token (?P<token>\d+) (?P<what>out|residual): "
                  r"max abs diff (?P<abs>\S+), max rel diff (?P<rel>\S+)$")


@pytest.fixture(autouse=True)
def logs(caplog, monkeypatch):
    monkeypatch.delenv("MINIMAX_OPS_CHECK", raising=False)
    monkeypatch.delenv("MINIMAX_OPS_CHECK_TOL", raising=False)
    caplog.set_level(logging.INFO, logger="minimax_ops")
    return caplog


def checked_lines(caplog) -> list[dict]:
    """The parsed checked-mode report lines logged so far."""
    found = []
    for record in caplog.records:
        m = LINE.match(record.getMessage()) if record.name == "minimax_ops" else None
        if m:
            found.append({**m.groupdict(), "layer": int(m["layer"]), "token": int(m["token"]),
                          "abs": float(m["abs"]), "rel": float(m["rel"])})
    return found


def same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None) == (b is None) and (a is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def caches_same(a, b) -> bool:
    return same_bytes(a.kv, b.kv) and same_bytes(a.index, b.index)


class Case:
    """One decoder layer of preset("tiny") with a decode step: layer module, cache, metadata, x, residual."""

    def __init__(self, layer_index: int, *, kv_dtype=torch.bfloat16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        weights = random_layer_weights(CFG, layer_index, linear_format="mxfp8", expert_format="mxfp4", generator=g)
        self.layer = MiniMaxM3DecoderLayer(CFG, weights, layer_index)
        self.kind = weights.kind
        self.cache = allocate_caches(CFG, NUM_BLOCKS, kv_dtype=kv_dtype, index_dtype=kv_dtype,
                                     generator=g)[layer_index]
        self.meta = build_step(CONTEXTS, QUERY_LEN, block_size=CFG.sparse_block_size, num_blocks=NUM_BLOCKS,
                               pad_requests=1, num_prefills=0, generator=g)
        n = self.meta.num_tokens
        self.x = torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16)
        self.residual = torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16)

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    def run(self, cache=None):
        """layer.fused_forward on a clone of the cache (or the given one): (out, residual, cache)."""
        cache = self.cache.clone() if cache is None else cache
        out, residual = self.layer.fused_forward(self.x, self.residual, self.meta.positions, cache, self.meta)
        return out, residual, cache

    def op_call(self, **extra):
        """The fused op called directly (what the graph pass emits), with extra keyword arguments."""
        c, m, layer, cache = CFG, self.meta, self.layer, self.cache.clone()
        dims = (m.query_len, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim, c.rope_theta,
                c.rms_norm_eps)
        if self.kind != SPARSE_MOE:
            return minimax.fused_dense_decode_layer(
                self.x, self.residual, m.positions, m.slot_mapping, m.block_table, m.seq_lens, cache.kv,
                *(getattr(layer, n) for n in DENSE_WEIGHTS), *dims, c.swiglu_alpha, c.swiglu_limit, 1.0, 1.0,
                **extra)
        return minimax.fused_decode_layer(
            self.x, self.residual, m.positions, m.slot_mapping, m.index_slot_mapping, m.block_table, m.seq_lens,
            cache.kv, cache.index, *(getattr(layer, n) for n in SPARSE_WEIGHTS), *dims, c.sparse_num_index_heads,
            c.sparse_index_dim, c.sparse_topk_blocks, c.num_experts_per_tok, c.routed_scaling_factor,
            c.num_local_experts, c.swiglu_alpha, c.swiglu_limit, 1.0, 1.0, **extra)


def hook_names(case: Case) -> tuple[str, str]:
    """fused.py's implementation hooks (attention half, FFN half) for the case's layer kind."""
    return ("SPARSE_ATTENTION_IMPL", "SPARSE_FFN_IMPL") if case.kind == SPARSE_MOE else \
        ("DENSE_ATTENTION_IMPL", "DENSE_FFN_IMPL")


def patch_fused(monkeypatch, case: Case, change):
    """Replace the fused implementation of the case's layer kind (its two halves) by the real one followed
    by ``change(out, residual, kv_cache, index_cache) -> (out, residual)``."""
    attention_name, ffn_name = hook_names(case)
    real_attention, real_ffn = getattr(fused_ops, attention_name), getattr(fused_ops, ffn_name)
    sparse = case.kind == SPARSE_MOE
    caches = []

    def attention(*args):
        caches[:] = (args[7], args[8]) if sparse else (args[6], None)
        return real_attention(*args)

    def ffn(*args):
        out, residual = real_ffn(*args)
        return change(out.clone(), residual.clone(), *caches)

    monkeypatch.setattr(fused_ops, attention_name, attention)
    monkeypatch.setattr(fused_ops, ffn_name, ffn)


def add_to_row(t: torch.Tensor, row: int, value) -> torch.Tensor:
    t[row] = (t[row].float() + value).to(t.dtype)
    return t


def flip_byte(cache: torch.Tensor, where: int = 0) -> None:
    flat = cache.view(torch.uint8).view(-1)
    flat[where] = flat[where] ^ 0x01


LAYERS = [pytest.param(DENSE, id="dense"), pytest.param(SPARSE, id="sparse")]


# ---- eager: reports, same results, caches written once -------------------------------------------------


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layer_index", LAYERS)
def test_eager_reports_every_token_and_changes_nothing(logs, monkeypatch, layer_index, kv_dtype):
    case = Case(layer_index, kv_dtype=kv_dtype)
    monkeypatch.setenv("MINIMAX_OPS_CHECK", "0")  # "0" means off
    plain_out, plain_res, plain_cache = case.run()
    assert checked_lines(logs) == [], "unchecked steps must not report"

    monkeypatch.setenv("MINIMAX_OPS_CHECK", "1")
    out, res, cache = case.run()
    assert torch.equal(out, plain_out) and torch.equal(res, plain_res)
    assert caches_same(cache, plain_cache), "checked mode changed the cache bytes"
    assert not caches_same(cache, case.cache), "the step wrote nothing"

    lines = checked_lines(logs)
    n = case.num_tokens
    assert sorted((ln["token"], ln["what"]) for ln in lines) == sorted(
        (t, what) for t in range(n) for what in ("out", "residual"))
    assert {(ln["layer"], ln["kind"]) for ln in lines} == {(layer_index, case.kind)}
    # Today the fused op runs the same stages: no difference at all (always within the default tolerance).
    assert all(ln["rel"] <= 2e-2 and ln["abs"] >= 0 for ln in lines)


def test_checked_argument_without_environment(logs):
    """The pass option sets the op's checked argument: reports without MINIMAX_OPS_CHECK, labelled
    with the op's layer_index."""
    case = Case(SPARSE)
    out, res = case.op_call()
    assert checked_lines(logs) == []
    out_c, res_c = case.op_call(layer_index=7, checked=True)
    assert torch.equal(out, out_c) and torch.equal(res, res_c)
    lines = checked_lines(logs)
    assert len(lines) == 2 * case.num_tokens
    assert {ln["layer"] for ln in lines} == {7}


@pytest.mark.parametrize("layer_index", LAYERS)
def test_caches_written_once_by_the_fused_path(monkeypatch, layer_index):
    """The fused implementation gets the real caches, the unfused chain clones; each runs once."""
    case = Case(layer_index)
    sparse = case.kind == SPARSE_MOE
    seen = []

    def spy(which, real):
        def call(*args):
            kv, index = (args[7], args[8]) if sparse else (args[6], None)
            seen.append((which, kv.data_ptr(), None if index is None else index.data_ptr()))
            return real(*args)
        return call

    chain_name = "sparse_attention" if sparse else "dense_attention"
    hook = hook_names(case)[0]
    monkeypatch.setattr(fused_ops, hook, spy("fused", getattr(fused_ops, hook)))
    monkeypatch.setattr(chain, chain_name, spy("unfused", getattr(chain, chain_name)))
    monkeypatch.setenv("MINIMAX_OPS_CHECK", "1")
    cache = case.cache.clone()
    real_ptrs = (cache.kv.data_ptr(), None if cache.index is None else cache.index.data_ptr())
    case.run(cache)
    assert [s[0] for s in seen] == ["fused", "unfused"]
    assert seen[0][1:] == real_ptrs
    assert seen[1][1] != real_ptrs[0] and (not sparse or seen[1][2] != real_ptrs[1])


# ---- eager: disagreement ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_index", LAYERS)
@pytest.mark.parametrize("what,token", [("out", 2), ("residual", 0), ("out", 5)])
def test_disagreement_names_layer_token_and_tensor(monkeypatch, layer_index, what, token):
    case = Case(layer_index)
    index = 0 if what == "out" else 1

    def perturb(out, residual, kv, idx):
        pair = [out, residual]
        add_to_row(pair[index], token, 0.5 * pair[index][token].float().abs().amax())
        return tuple(pair)

    patch_fused(monkeypatch, case, perturb)
    monkeypatch.setenv("MINIMAX_OPS_CHECK", "1")
    pattern = (rf"layer {layer_index} \({case.kind}\) token {token} {what}: relative difference \S+ exceeds "
               r"MINIMAX_OPS_CHECK_TOL=0\.02")
    with pytest.raises(CheckedModeError, match=pattern):
        case.run()
    # Without checked mode the same implementation runs unnoticed.
    monkeypatch.setenv("MINIMAX_OPS_CHECK", "0")
    case.run()


@pytest.mark.parametrize("layer_index", LAYERS)
def test_absolute_perturbation_of_half(monkeypatch, layer_index):
    """The issue's example: +0.5 on the output fails at the default tolerance, passes with a loose one."""
    case = Case(layer_index)
    patch_fused(monkeypatch, case, lambda out, res, kv, idx: ((out.float() + 0.5).to(out.dtype), res))
    monkeypatch.setenv("MINIMAX_OPS_CHECK", "1")
    with pytest.raises(CheckedModeError, match=rf"layer {layer_index} \({case.kind}\) token 0 out"):
        case.run()
    monkeypatch.setenv("MINIMAX_OPS_CHECK_TOL", "1e3")
    case.run()


@pytest.mark.parametrize("layer_index", LAYERS)
def test_perturbation_below_tolerance_passes(logs, monkeypatch, layer_index):
    """A 1% change of one row passes the default 2e-2 (and is reported), fails a 1e-3 tolerance."""
    case = Case(layer_index)
    token = 1
    patch_fused(monkeypatch, case, lambda out, res, kv, idx: (
        add_to_row(out, token, 0.01 * out[token].float().abs().amax()), res))
    monkeypatch.setenv("MINIMAX_OPS_CHECK", "1")
    case.run()
    rel = {(ln["token"], ln["what"]): ln["rel"] for ln in checked_lines(logs)}
    assert 5e-3 < rel[(token, "out")] < 2e-2
    assert rel[(0, "out")] == 0 and rel[(token, "residual")] == 0

    monkeypatch.setenv("MINIMAX_OPS_CHECK_TOL", "1e-3")
    with pytest.raises(CheckedModeError, match=rf"token {token} out: .* exceeds MINIMAX_OPS_CHECK_TOL=0\.001"):
        case.run()


@pytest.mark.parametrize("layer_index", LAYERS)
def test_nan_output_fails(monkeypatch, layer_index):
    case = Case(layer_index)
    patch_fused(monkeypatch, case, lambda out, res, kv, idx: (add_to_row(out, 3, float("nan")), res))
    monkeypatch.setenv("MINIMAX_OPS_CHECK", "1")
    with pytest.raises(CheckedModeError, match=r"token 3 out: relative difference nan"):
        case.run()


@pytest.mark.parametrize("layer_index,cache_name", [(DENSE, "kv_cache"), (SPARSE, "kv_cache"),
                                                    (SPARSE, "index_cache")], ids=["dense-kv", "sparse-kv", "index"])
def test_different_cache_byte_fails(monkeypatch, layer_index, cache_name):
    case = Case(layer_index)

    def corrupt(out, res, kv, index):
        target = kv if cache_name == "kv_cache" else index
        flip_byte(target, where=target.numel())  # a byte in the middle of the cache
        return out, res

    patch_fused(monkeypatch, case, corrupt)
    monkeypatch.setenv("MINIMAX_OPS_CHECK", "1")
    with pytest.raises(CheckedModeError,
                       match=rf"layer {layer_index} \({case.kind}\): fused and unfused paths wrote different "
                             rf"{cache_name} bytes"):
        case.run()


# ---- whole model, eager ------------------------------------------------------------------------------------


def test_model_use_fused_ops_checked(logs, monkeypatch):
    config, weights = gt.tiny2_weights()
    model = MiniMaxM3ForCausalLM(config, weights)
    model.use_fused_ops = True
    ids, meta, caches = gt.step_inputs(config, CONTEXTS, QUERY_LEN, seed=3)
    plain_caches, ref_caches = [c.clone() for c in caches], [c.clone() for c in caches]
    plain = model(ids, meta.positions, plain_caches, meta)
    assert checked_lines(logs) == []

    monkeypatch.setenv("MINIMAX_OPS_CHECK", "1")
    logits = model(ids, meta.positions, caches, meta)
    assert torch.equal(logits, plain)
    assert all(caches_same(a, b) for a, b in zip(caches, plain_caches))
    ref = model_forward(ids, weights, ref_caches, meta, config)
    assert gt.relative_error(logits, ref) < 1e-2
    lines = checked_lines(logs)
    n = meta.num_tokens
    assert sorted((ln["layer"], ln["kind"], ln["token"], ln["what"]) for ln in lines) == sorted(
        (layer, kind, t, what) for layer, kind in ((0, "dense"), (1, SPARSE_MOE)) for t in range(n)
        for what in ("out", "residual"))


# ---- compiled with MiniMaxM3DecodePass(checked=True) ----------------------------------------------------


@pytest.fixture(scope="module")
def compiled_checked():
    """tiny2 (dense layer 0, sparse layer 1) compiled once with the checked pass; Inductor caches off."""
    config, weights = gt.tiny2_weights()
    graph_pass = MiniMaxM3DecodePass(checked=True, record=True)
    compiled = gt.compile_model(MiniMaxM3ForCausalLM(config, weights), graph_pass)
    ids, meta, caches = gt.step_inputs(config, CONTEXTS, QUERY_LEN, seed=4)
    with gt.uncached_compiles():  # compile here, so that each test sees the compiled graph's steps only
        compiled(ids, meta.positions, caches, meta)
    assert graph_pass.calls == 1
    return config, weights, graph_pass, compiled


def test_compiled_checked_pass_reports_layers_0_and_1(logs, compiled_checked):
    config, weights, graph_pass, compiled = compiled_checked
    ids, meta, caches = gt.step_inputs(config, CONTEXTS, QUERY_LEN, seed=7)
    result = gt.run_against_reference(compiled, config, weights, ids, meta, caches)
    assert graph_pass.rewrites == 2 and graph_pass.calls == 1
    fused_calls = {n.op: n.kwargs for n in gt.parse_graph(graph_pass.graphs[-1][1]) if n.op in FUSED_OPS}
    assert {op: (kw["layer_index"], kw["checked"]) for op, kw in fused_calls.items()} == {
        "minimax.fused_dense_decode_layer": ("0", "True"), "minimax.fused_decode_layer": ("1", "True")}
    assert result.fused_runs == {"dense": 1, "sparse": 1}
    assert gt.relative_error(result.out, result.ref) < 1e-2
    assert result.caches_match
    lines = checked_lines(logs)
    n = meta.num_tokens
    assert sorted((ln["layer"], ln["kind"], ln["token"], ln["what"]) for ln in lines) == sorted(
        (layer, kind, t, what) for layer, kind in ((0, "dense"), (1, SPARSE_MOE)) for t in range(n)
        for what in ("out", "residual"))
    assert all(ln["rel"] <= 2e-2 for ln in lines)


def test_compiled_checked_pass_disagreement(monkeypatch, compiled_checked):
    """The compiled graph calls the fused op's Python implementation: a perturbed one is caught there,
    and the error keeps its type through the compiled code."""
    config, weights, graph_pass, compiled = compiled_checked
    ids, meta, caches = gt.step_inputs(config, CONTEXTS, QUERY_LEN, seed=5)
    real = fused_ops.SPARSE_FFN_IMPL

    def perturbed(*args):
        out, residual = real(*args)
        return add_to_row(out.clone(), 1, 0.5 * out[1].float().abs().amax()), residual

    monkeypatch.setattr(fused_ops, "SPARSE_FFN_IMPL", perturbed)
    calls = graph_pass.calls
    with gt.uncached_compiles(), pytest.raises(CheckedModeError, match=r"layer 1 \(sparse_moe\) token 1 out"):
        compiled(ids, meta.positions, caches, meta)
    assert graph_pass.calls == calls, "the step recompiled instead of reusing the checked graph"


def test_compiled_default_pass_follows_the_environment(logs, monkeypatch):
    """MINIMAX_OPS_CHECK is read when the fused op runs, not when it is traced: one graph compiled with
    the default pass serves checked and unchecked steps."""
    config, weights = gt.tiny2_weights()
    graph_pass = MiniMaxM3DecodePass()
    compiled = gt.compile_model(MiniMaxM3ForCausalLM(config, weights), graph_pass)
    ids, meta, caches = gt.step_inputs(config, CONTEXTS, QUERY_LEN, seed=6)
    plain_caches = [c.clone() for c in caches]
    plain = gt.run_against_reference(compiled, config, weights, ids, meta, plain_caches)
    assert graph_pass.rewrites == 2 and plain.fused_runs == {"dense": 1, "sparse": 1}
    assert checked_lines(logs) == []

    monkeypatch.setenv("MINIMAX_OPS_CHECK", "1")
    checked = gt.run_against_reference(compiled, config, weights, ids, meta, caches)
    assert graph_pass.calls == 1, "checked mode must not recompile"
    assert torch.equal(checked.out, plain.out) and checked.caches_match
    assert gt.caches_equal(caches, plain_caches)
    assert {(ln["layer"], ln["kind"]) for ln in checked_lines(logs)} == {(0, "dense"), (1, SPARSE_MOE)}
    assert len(checked_lines(logs)) == 2 * 2 * meta.num_tokens
