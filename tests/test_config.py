"""MiniMaxM3Config: presets, HuggingFace config.json round trips, validation messages."""

import json

import pytest

from minimax_ops.config import DENSE, SPARSE_MOE, ConfigError, MiniMaxM3Config, preset


def test_real_preset_values():
    c = preset("real")
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size) == (6144, 60, 200064)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (64, 4, 128)
    assert (c.rotary_dim, c.rope_theta, c.rms_norm_eps) == (64, 5e6, 1e-6)
    assert (c.num_local_experts, c.num_experts_per_tok, c.n_shared_experts) == (128, 4, 1)
    assert (c.intermediate_size, c.shared_intermediate_size, c.dense_intermediate_size) == (3072, 3072, 12288)
    assert c.routed_scaling_factor == 2.0
    assert (c.sparse_block_size, c.sparse_topk_blocks) == (128, 16)
    assert (c.sparse_num_index_heads, c.sparse_index_dim) == (4, 128)
    assert (c.q_size, c.kv_size, c.index_q_size) == (8192, 512, 512)
    assert c.qkv_size(0) == 9216 and c.qkv_size(2) == 9216
    assert c.qkv_size(3) == 9856 and c.qkv_size(59) == 9856
    assert c.layer_kinds == (DENSE,) * 3 + (SPARSE_MOE,) * 57
    assert c.num_dense_prefix == 3


def test_tiny_preset_has_dense_and_sparse_layers():
    c = preset("tiny")
    assert DENSE in c.layer_kinds and SPARSE_MOE in c.layer_kinds
    assert c.layer_kinds[0] == DENSE and c.num_dense_prefix >= 1
    # Small enough for CPU tests, still exercising block selection and GQA.
    assert c.hidden_size <= 256 and c.sparse_block_size <= 32
    assert c.num_attention_heads // c.num_key_value_heads > 1
    assert c.rotary_dim < c.head_dim
    assert c.qkv_size(c.num_hidden_layers - 1) == c.qkv_size(0) + c.index_q_size + c.sparse_index_dim
    tiny2 = preset("tiny2")
    assert tiny2.layer_kinds == (DENSE, SPARSE_MOE)


def test_unknown_preset_and_layer_index():
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")
    with pytest.raises(ConfigError, match="layer index 60"):
        preset("real").layer_kind(60)


@pytest.mark.parametrize("name", ["real", "tiny"])
def test_hf_dict_round_trip(name):
    c = preset(name)
    d = c.to_hf_dict()
    # Must be plain JSON (it is what config.json holds).
    d = json.loads(json.dumps(d))
    assert d["sparse_attention_config"]["sparse_block_size"] == c.sparse_block_size
    assert "sparse_block_size" not in d
    assert MiniMaxM3Config.from_hf_dict(d) == c


def test_nested_text_config():
    c = preset("tiny")
    outer = {"architectures": ["MiniMaxM3ForConditionalGeneration"], "vision_config": {"hidden_size": 1},
             "text_config": c.to_hf_dict()}
    assert MiniMaxM3Config.from_hf_dict(outer) == c


def _tiny_hf(**changes):
    d = preset("tiny").to_hf_dict()
    d.update(changes)
    return d


def test_partial_rotary_factor_instead_of_rotary_dim():
    d = _tiny_hf(partial_rotary_factor=0.25)
    del d["rotary_dim"]
    c = MiniMaxM3Config.from_hf_dict(d)
    assert c.rotary_dim == preset("tiny").head_dim // 4
    real = preset("real").to_hf_dict()
    del real["rotary_dim"]
    real["partial_rotary_factor"] = 0.5
    assert MiniMaxM3Config.from_hf_dict(real).rotary_dim == 64


def test_defaults_and_alternative_keys():
    # Missing layer flags: 3 dense then sparse; num_experts as an alias; every-k-th-layer int form.
    d = _tiny_hf(num_hidden_layers=5, num_experts=4)
    del d["moe_layer_freq"], d["sparse_attention_config"]["sparse_attention_freq"], d["num_local_experts"]
    c = MiniMaxM3Config.from_hf_dict(d)
    assert c.layer_kinds == (DENSE,) * 3 + (SPARSE_MOE,) * 2
    assert c.num_local_experts == 4
    d = _tiny_hf(num_hidden_layers=4, moe_layer_freq=2)
    d["sparse_attention_config"]["sparse_attention_freq"] = 2
    assert MiniMaxM3Config.from_hf_dict(d).layer_kinds == (DENSE, SPARSE_MOE, DENSE, SPARSE_MOE)


@pytest.mark.parametrize("changes,field", [
    ({"num_attention_heads": 6}, "num_attention_heads"),  # kv heads = 4
    ({"moe_layer_freq": [0, 0, 1]}, "moe_layer_freq"),  # 60 layers
    ({"moe_layer_freq": [0] * 3 + [2] * 57}, "moe_layer_freq"),
    ({"sparse_num_index_heads": 2}, "sparse_num_index_heads"),
    ({"sparse_index_dim": 64}, "sparse_index_dim"),
    ({"hidden_size": 6150}, "hidden_size"),
    ({"intermediate_size": 3000}, "intermediate_size"),
    ({"hidden_size": "6144"}, "hidden_size"),
    ({"num_key_value_heads": 4.0}, "num_key_value_heads"),
    ({"head_dim": True}, "head_dim"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"rotary_dim": 65}, "rotary_dim"),
    ({"rotary_dim": 256}, "rotary_dim"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"hidden_act": "silu"}, "hidden_act"),
    ({"sparse_local_block": 2}, "sparse_local_block"),
    ({"sparse_score_type": "mean"}, "sparse_score_type"),
])
def test_validation_names_the_field(changes, field):
    with pytest.raises(ConfigError, match=f"'[a-z_.]*{field}'"):
        preset("real").replace(**changes)


def test_validation_from_hf_dict():
    d = preset("real").to_hf_dict()
    d["sparse_attention_config"]["sparse_num_index_heads"] = 8
    with pytest.raises(ConfigError, match="sparse_num_index_heads.*num_key_value_heads=4"):
        MiniMaxM3Config.from_hf_dict(d)
    d = preset("real").to_hf_dict()
    d["moe_layer_freq"] = d["moe_layer_freq"][:-1]
    with pytest.raises(ConfigError, match="'moe_layer_freq': expected 60 flags"):
        MiniMaxM3Config.from_hf_dict(d)
    d = preset("real").to_hf_dict()
    d["sparse_attention_config"]["sparse_attention_freq"] = [0] * 60
    with pytest.raises(ConfigError, match="sparse_attention_freq.*layer 3"):
        MiniMaxM3Config.from_hf_dict(d)
    with pytest.raises(ConfigError, match="expected a config.json dict"):
        MiniMaxM3Config.from_hf_dict([("hidden_size", 6144)])
