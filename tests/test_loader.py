"""loader.py: safetensors checkpoints in the MiniMax-M2 family's tensor names <-> fused ModelWeights.

Round trips are bit-exact for every format mix and both shared-expert layouts; the checkpoint's
names and split tensors are checked against the fused ones directly; a loaded model reproduces
the reference; every malformed checkpoint fails with the offending tensor named."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from minimax_ops import reference_model as rm
from minimax_ops.cache import allocate_caches, build_step
from minimax_ops.config import preset
from minimax_ops.loader import (CheckpointError, checkpoint_tensors, load_model, load_weights, save_checkpoint,
                                weights_from_tensors)
from minimax_ops.model import MiniMaxM3ForCausalLM
from minimax_ops.weights import SHARED_IN_TABLE, SHARED_SEPARATE, random_model_weights

CFG = preset("tiny")  # layer 0 dense, layers 1-2 sparse MoE, 8 experts
E, I = CFG.num_local_experts, CFG.intermediate_size
FORMATS = {"bf16": dict(linear_format="bf16"), "mxfp8+mxfp4": dict(linear_format="mxfp8", expert_format="mxfp4")}


def _weights(fmt="bf16", shared=SHARED_SEPARATE, seed=0, **extra):
    return random_model_weights(CFG, generator=torch.Generator().manual_seed(seed), shared=shared,
                                **FORMATS[fmt], **extra)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _assert_bit_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(_bits(a), _bits(b)), f"{what}: values differ"


def _assert_weights_equal(a, b) -> None:
    for name in ("embed", "final_norm", "lm_head"):
        _assert_bit_equal(getattr(a, name), getattr(b, name), name)
    assert len(a.layers) == len(b.layers)
    for i, (la, lb) in enumerate(zip(a.layers, b.layers)):
        assert la.kind == lb.kind
        ta, tb = la.tensors(), lb.tensors()
        assert ta.keys() == tb.keys(), f"layer {i}: fields {sorted(ta.keys() ^ tb.keys())} differ"
        for name in ta:
            _assert_bit_equal(ta[name], tb[name], f"layers[{i}].{name}")


@pytest.mark.parametrize("shared", [SHARED_SEPARATE, SHARED_IN_TABLE])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_round_trip_is_bit_exact(tmp_path, fmt, shared):
    w = _weights(fmt, shared)
    files = save_checkpoint(w, CFG, tmp_path)
    assert files == [tmp_path / "model.safetensors"] and (tmp_path / "config.json").exists()
    config, loaded = load_weights(tmp_path, shared=shared)
    assert config == CFG
    _assert_weights_equal(w, loaded)
    assert loaded.layers[1].shared_in_table == (shared == SHARED_IN_TABLE)


def test_checkpoint_names_and_split_tensors(tmp_path):
    """The file holds the unfused MiniMax-M2 names; each split tensor is the right slice of the fused one."""
    w = _weights("mxfp8+mxfp4", SHARED_SEPARATE)
    save_checkpoint(w, CFG, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    attn0, attn1 = "model.layers.0.self_attn.", "model.layers.1.self_attn."
    moe = "model.layers.1.block_sparse_moe."
    # dense layer: no index projections, no experts; MXFP8 scales are weight_scale_inv
    assert not any(k.startswith(attn0 + "index_") or k.startswith("model.layers.0.block_sparse_moe") for k in sd)
    for k in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight_scale_inv"):
        assert "model.layers.0." + k in sd
    assert not any("qkv" in k or "w13" in k for k in sd)
    expected_layer1 = {
        attn1 + f"{p}.{s}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "index_q_proj", "index_k_proj")
        for s in ("weight", "weight_scale_inv")} | {
        attn1 + f"{n}.weight" for n in ("q_norm", "k_norm", "index_q_norm", "index_k_norm")} | {
        moe + f"experts.{e}.{p}.{s}" for e in range(E) for p in ("w1", "w3", "w2")
        for s in ("weight", "weight_scale")} | {
        moe + f"shared_experts.{p}.{s}" for p in ("gate_proj", "up_proj", "down_proj")
        for s in ("weight", "weight_scale")} | {
        moe + "gate.weight", moe + "e_score_correction_bias", "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight"}
    assert {k for k in sd if k.startswith("model.layers.1.")} == expected_layer1
    assert len(sd) == len(checkpoint_tensors(w, CFG))

    lw = w.layers[1]
    q, kv, iq = CFG.q_size, CFG.kv_size, CFG.index_q_size
    _assert_bit_equal(sd[attn1 + "k_proj.weight"], lw.qkv[q:q + kv], "k_proj")
    _assert_bit_equal(sd[attn1 + "index_q_proj.weight_scale_inv"], lw.qkv_scale[q + 2 * kv:q + 2 * kv + iq],
                      "index_q_proj scale")
    _assert_bit_equal(sd[attn1 + "index_k_proj.weight"], lw.qkv[q + 2 * kv + iq:], "index_k_proj")
    e = 5
    assert sd[moe + f"experts.{e}.w1.weight"].dtype == torch.uint8  # packed MXFP4 [I, H/2]
    assert tuple(sd[moe + f"experts.{e}.w1.weight"].shape) == (I, CFG.hidden_size // 2)
    _assert_bit_equal(sd[moe + f"experts.{e}.w1.weight"], lw.w13[e, :I], "w1 = gate rows")
    _assert_bit_equal(sd[moe + f"experts.{e}.w3.weight_scale"], lw.w13_scale[e, I:], "w3 = up rows")
    _assert_bit_equal(sd[moe + f"experts.{e}.w2.weight"], lw.w2[e], "w2 = down")
    _assert_bit_equal(sd[moe + "shared_experts.up_proj.weight"], lw.shared_w13[CFG.shared_intermediate_size:],
                      "shared up")
    assert sd[moe + "gate.weight"].dtype == torch.float32 and sd[moe + "e_score_correction_bias"].dtype == torch.float32


def test_shared_expert_moves_between_layouts(tmp_path):
    """A separate shared expert loads as table entry E, and that table saves back to the same checkpoint."""
    w = _weights("mxfp8+mxfp4", SHARED_SEPARATE)
    save_checkpoint(w, CFG, tmp_path / "a")
    _, table = load_weights(tmp_path / "a", shared=SHARED_IN_TABLE)
    for i in (1, 2):
        lw, lt = w.layers[i], table.layers[i]
        assert lt.shared_w13 is None and lt.w13.shape[0] == E + 1
        _assert_bit_equal(lt.w13[E], lw.shared_w13, f"layer {i} table entry E")
        _assert_bit_equal(lt.w2_scale[E], lw.shared_w2_scale, f"layer {i} table entry E scale")
        _assert_bit_equal(lt.w13[:E], lw.w13, f"layer {i} routed experts")
    save_checkpoint(table, CFG, tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        _assert_bit_equal(a[k], b[k], k)


def test_shared_in_table_needs_the_experts_format(tmp_path):
    w = _weights("mxfp8+mxfp4", SHARED_SEPARATE, shared_format="mxfp8")
    save_checkpoint(w, CFG, tmp_path)
    _, loaded = load_weights(tmp_path)  # separate: any format
    assert loaded.layers[1].shared_w13.dtype == torch.float8_e4m3fn
    with pytest.raises(CheckpointError, match=r"shared_experts\.gate_proj\.weight: format mxfp8 differs"):
        load_weights(tmp_path, shared=SHARED_IN_TABLE)


def test_sharded_checkpoint(tmp_path):
    w = _weights("mxfp8+mxfp4", SHARED_IN_TABLE, seed=3)
    files = save_checkpoint(w, CFG, tmp_path, max_shard_bytes=64 * 1024)
    assert len(files) > 2 and all(f.exists() for f in files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    for f in files:  # tensor bytes per shard stay within the limit unless one tensor alone exceeds it
        shard = load_file(f)
        assert len(shard) == 1 or sum(t.numel() * t.element_size() for t in shard.values()) <= 64 * 1024
    _, loaded = load_weights(tmp_path, shared=SHARED_IN_TABLE)
    _assert_weights_equal(w, loaded)


def test_single_file_path_and_explicit_config(tmp_path):
    w = _weights("bf16", seed=4)
    save_checkpoint(w, CFG, tmp_path / "m.safetensors")
    config, loaded = load_weights(tmp_path / "m.safetensors")
    assert config == CFG
    _assert_weights_equal(w, loaded)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_weights(tmp_path / "m.safetensors")
    _, again = load_weights(tmp_path / "m.safetensors", CFG)
    _assert_weights_equal(w, again)


def test_tied_embeddings_skip_lm_head(tmp_path):
    config = CFG.replace(tie_word_embeddings=True)
    w = _weights("bf16", seed=5)
    w.lm_head = w.embed
    save_checkpoint(w, config, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded_config, loaded = load_weights(tmp_path)
    assert loaded_config.tie_word_embeddings
    _assert_bit_equal(loaded.lm_head, w.embed, "tied lm_head")


@pytest.mark.parametrize("fmt,shared", [("bf16", SHARED_SEPARATE), ("mxfp8+mxfp4", SHARED_IN_TABLE)])
def test_loaded_model_matches_reference_on_prefill(tmp_path, fmt, shared):
    w = _weights(fmt, shared, seed=6)
    save_checkpoint(w, CFG, tmp_path)
    model = load_model(tmp_path, shared=shared)
    assert isinstance(model, MiniMaxM3ForCausalLM)
    gen = torch.Generator().manual_seed(7)
    meta = build_step([0, 0], [21, 9], block_size=CFG.sparse_block_size, num_blocks=16, generator=gen)
    ids = torch.randint(0, CFG.vocab_size, (meta.num_tokens,), generator=gen)
    caches = allocate_caches(CFG, 16, generator=gen)
    caches_orig = [c.clone() for c in caches]
    caches_ref = [c.clone() for c in caches]
    logits = model(ids, meta.positions, caches, meta)
    logits_orig = MiniMaxM3ForCausalLM(CFG, w)(ids, meta.positions, caches_orig, meta)
    expected = rm.model_forward(ids, w, caches_ref, meta, CFG)
    assert torch.equal(logits, logits_orig)  # same weights bit for bit -> same logits bit for bit
    rel = ((logits - expected).norm() / expected.norm()).item()
    assert rel < 1e-2, rel
    for c, r in zip(caches, caches_ref):
        assert torch.equal(_bits(c.kv), _bits(r.kv))


# ---- malformed checkpoints -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_tensors():
    return checkpoint_tensors(_weights("mxfp8+mxfp4", SHARED_SEPARATE, seed=8), CFG)


def _load_edited(tmp_path, tensors, edit):
    sd = dict(tensors)
    edit(sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    return load_weights(tmp_path, CFG)


L1 = "model.layers.1."


def _set(name, value):
    """Edit: store value(sd) (or value itself) under name."""
    return lambda sd: sd.__setitem__(name, value(sd) if callable(value) else value)


def _drop(*names):
    return lambda sd: [sd.pop(n) for n in names]


def _rename(old, new):
    return lambda sd: sd.__setitem__(new, sd.pop(old))


def _to_bf16(name, drop_scale):
    """Edit: store a quantised weight as bf16 (optionally dropping its scale)."""
    def edit(sd):
        sd[name + ".weight"] = sd[name + ".weight"].to(torch.bfloat16)
        if drop_scale:
            sd.pop(name + ".weight_scale_inv")
    return edit


EXPERT = L1 + "block_sparse_moe.experts."
CASES = {
    "unknown name": (_set(L1 + "self_attn.rotary.weight", torch.ones(4)),
                     r"unknown tensor name 'model\.layers\.1\.self_attn\.rotary\.weight'"),
    "layer beyond config": (_set("model.layers.3.input_layernorm.weight", torch.ones(4)),
                            r"unknown tensor name 'model\.layers\.3\.input_layernorm\.weight'"),
    "missing expert": (_drop(EXPERT + "3.w2.weight"),
                       r"missing tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight'"),
    "missing scale": (_drop(L1 + "self_attn.k_proj.weight_scale_inv"),
                      r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight_scale_inv'.*MXFP8"),
    "missing bias": (_drop(L1 + "block_sparse_moe.e_score_correction_bias"),
                     r"missing tensor 'model\.layers\.1\.block_sparse_moe\.e_score_correction_bias'"),
    "mis-shaped q_proj": (_set(L1 + "self_attn.q_proj.weight",
                               lambda sd: sd[L1 + "self_attn.q_proj.weight"][:-1].clone()),
                          r"model\.layers\.1\.self_attn\.q_proj\.weight: expected shape \(256, 64\), got \(255, 64\)"),
    "mis-shaped scale": (_set(EXPERT + "0.w2.weight_scale", torch.ones(64, 2, dtype=torch.uint8)),
                         r"experts\.0\.w2\.weight_scale: expected shape \(64, 1\), got \(64, 2\)"),
    "mis-shaped norm": (_set("model.norm.weight", torch.ones(65, dtype=torch.bfloat16)),
                        r"model\.norm\.weight: expected shape \(64,\), got \(65,\)"),
    "wrong gate dtype": (_set(L1 + "block_sparse_moe.gate.weight", torch.ones(E, 64, dtype=torch.int32)),
                         r"block_sparse_moe\.gate\.weight: expected dtype torch\.float32 or torch\.bfloat16, "
                         r"got torch\.int32"),
    "wrong weight dtype": (_set("model.layers.0.mlp.up_proj.weight", torch.ones(96, 64, dtype=torch.float16)),
                           r"model\.layers\.0\.mlp\.up_proj\.weight: expected dtype .*got torch\.float16"),
    "fp32 embedding": (_set("model.embed_tokens.weight", torch.ones(256, 64)),
                       r"model\.embed_tokens\.weight: expected dtype torch\.bfloat16, got torch\.float32"),
    "wrong scale dtype": (_set(L1 + "self_attn.o_proj.weight_scale_inv",
                               lambda sd: sd[L1 + "self_attn.o_proj.weight_scale_inv"].float()),
                          r"self_attn\.o_proj\.weight_scale_inv: expected dtype torch\.uint8, got torch\.float32"),
    "fp8 weight with fp4 scale name": (_rename(L1 + "self_attn.o_proj.weight_scale_inv",
                                               L1 + "self_attn.o_proj.weight_scale"),
                                       r"self_attn\.o_proj\.weight_scale: unexpected tensor.*weight_scale_inv"),
    "bf16 weight with a scale": (_to_bf16(L1 + "self_attn.v_proj", drop_scale=False),
                                 r"self_attn\.v_proj\.weight_scale_inv: unexpected tensor"),
    "mixed qkv formats": (_to_bf16(L1 + "self_attn.v_proj", drop_scale=True),
                          r"self_attn\.v_proj\.weight: format bf16 differs from .*q_proj\.weight's mxfp8"),
    "mixed expert formats": (lambda sd: (_drop(EXPERT + "2.w2.weight_scale")(sd),
                                         _set(EXPERT + "2.w2.weight", torch.ones(64, I, dtype=torch.bfloat16))(sd)),
                             r"experts\.2\.w2\.weight: format bf16 differs from .*experts\.0\.w2\.weight's mxfp4"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_checkpoint_names_the_tensor(tmp_path, good_tensors, case):
    edit, message = CASES[case]
    with pytest.raises(CheckpointError, match=message):
        _load_edited(tmp_path, good_tensors, edit)


def test_unedited_tensors_load(tmp_path, good_tensors):
    _load_edited(tmp_path, good_tensors, lambda sd: None)  # the cases above fail only through their edit


def test_state_dict_entry_point_and_bad_shared():
    w = _weights("bf16", seed=9)
    _assert_weights_equal(w, weights_from_tensors(checkpoint_tensors(w, CFG), CFG))
    with pytest.raises(ValueError, match="shared"):
        weights_from_tensors(checkpoint_tensors(w, CFG), CFG, shared="both")


def test_save_refuses_weights_that_do_not_fit_the_config(tmp_path):
    w = _weights("bf16", seed=10)
    w.layers[1], w.layers[0] = w.layers[0], w.layers[1]
    with pytest.raises(CheckpointError, match=r"weights\.layers\[0\]: a sparse_moe layer"):
        save_checkpoint(w, CFG, tmp_path)
    w = _weights("bf16", seed=10)
    w.layers[2].o_proj = w.layers[2].o_proj[:, :-32]
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.o_proj\.weight: expected shape"):
        save_checkpoint(w, CFG, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
