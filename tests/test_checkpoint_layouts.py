"""The official release's layouts: the VL checkpoint (text model under language_model., vision, projector
and MTP tensors skipped by rule), both config.json forms, and bad checkpoints failing with named errors
(through loader.py and through the vLLM model's load_weights)."""

from __future__ import annotations

import json

import pytest
import torch

from minimax_ops.config import ConfigError, MiniMaxM3Config
from minimax_ops.loader import CheckpointError, load_weights, text_model_names
from vllm_checkpoint import TINY, release_config, write_checkpoint


def test_vl_release_layout_loads_its_text_model_and_reports_what_it_skipped(tmp_path, minimax_log):
    written = write_checkpoint(tmp_path)
    config, weights = load_weights(tmp_path)
    assert config == TINY
    assert torch.equal(weights.embed, written.embed) and torch.equal(weights.layers[3].w13, written.layers[3].w13)
    assert any("skipped tensors the text decoder does not use: 1 MTP, 1 projector, 1 vision tower" in r.getMessage()
               for r in minimax_log.records)


def test_a_stray_tensor_outside_the_language_model_is_rejected_by_name():
    names = ["language_model.model.norm.weight", "speech_tower.conv.weight"]
    with pytest.raises(CheckpointError, match="unknown tensor name 'speech_tower.conv.weight'"):
        text_model_names(names)


@pytest.mark.parametrize("edit,fragment", [
    (lambda t: t.pop("language_model.model.layers.2.self_attn.index_k_proj.weight"),
     "missing tensor 'model.layers.2.self_attn.index_k_proj.weight'"),
    (lambda t: t.__setitem__("language_model.model.layers.1.mlp.up_proj.weight", torch.zeros(3, 64, dtype=torch.bfloat16)),
     "model.layers.1.mlp.up_proj.weight: expected shape (64, 64), got (3, 64)"),
    (lambda t: t.__setitem__("language_model.model.norm.weight", torch.zeros(64, dtype=torch.float16)),
     "model.norm.weight: expected dtype torch.bfloat16 or torch.float32, got torch.float16"),
    (lambda t: t.__setitem__("language_model.model.layers.0.self_attn.extra.weight", torch.ones(2)),
     "unknown tensor name 'model.layers.0.self_attn.extra.weight'"),
], ids=["missing", "shape", "dtype", "extra"])
def test_bad_checkpoints_fail_at_load_with_a_named_error(tmp_path, edit, fragment):
    write_checkpoint(tmp_path, edit=edit)
    with pytest.raises(CheckpointError) as info:
        load_weights(tmp_path)
    assert fragment in str(info.value)


def transformers_form(config: MiniMaxM3Config) -> dict:
    """The text config as transformers' save_pretrained writes it for this model (field names of
    MiniMaxM3VLTextConfig): layer_types / mlp_layer_types, flat index_*, rope_parameters."""
    text = release_config(config)["text_config"]
    sparse = text.pop("sparse_attention_config")
    moe = text.pop("moe_layer_freq")
    text.pop("rope_theta")
    text.update(layer_types=["minimax_m3_sparse" if f else "full_attention" for f in sparse["sparse_attention_freq"]],
                mlp_layer_types=["sparse" if f else "dense" for f in moe], index_n_heads=sparse["sparse_num_index_heads"],
                index_head_dim=sparse["sparse_index_dim"], index_block_size=sparse["sparse_block_size"],
                index_topk_blocks=sparse["sparse_topk_blocks"], index_local_blocks=sparse["sparse_local_block"],
                rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
                partial_rotary_factor=config.rotary_dim / config.head_dim, hidden_act="silu",
                model_type="minimax_m3_vl_text")
    return {"model_type": "minimax_m3_vl", "text_config": text}


def test_transformers_form_config_reads_the_same_model():
    tiny = TINY.replace(rope_theta=12345.0, moe_layer_freq=(0, 1, 0, 1), sparse_attention_freq=(0, 1, 0, 1))
    d = json.loads(json.dumps(transformers_form(tiny)))
    assert MiniMaxM3Config.from_hf_dict(d) == tiny  # its own rope_theta and layer pattern, not the defaults


@pytest.mark.parametrize("change,fragment", [
    (lambda t: t.__setitem__("layer_types", ["full_attention", "sliding_attention", "full_attention",
                                             "minimax_m3_sparse"]), "config field 'layer_types'"),
    (lambda t: t.__setitem__("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}),
     "only 'default' RoPE is supported, got 'yarn'"),
    (lambda t: t.__setitem__("moe_layer_freq", [1, 1, 1, 1]), "config field 'moe_layer_freq': the release form says"),
    (lambda t: t.__setitem__("rotary_dim", 32), "config field 'rotary_dim'"),
], ids=["layer-type", "rope-type", "forms-disagree", "rotary-disagrees"])
def test_transformers_form_config_is_never_misread(change, fragment):
    d = transformers_form(TINY)
    change(d["text_config"])
    with pytest.raises(ConfigError) as info:
        MiniMaxM3Config.from_hf_dict(d)
    assert fragment in str(info.value)



def test_fp8_kv_scales_are_read_per_layer_and_checked(tmp_path):
    from minimax_ops.loader import load_model

    def add_scales(t):
        t["language_model.model.layers.2.self_attn.k_scale"] = torch.tensor(0.5)
        t["language_model.model.layers.2.self_attn.v_scale"] = torch.tensor(3.0)
    write_checkpoint(tmp_path / "ok", edit=add_scales)
    model = load_model(tmp_path / "ok")
    assert [(layer.k_scale, layer.v_scale) for layer in model.model.layers] == [(1.0, 1.0)] * 2 + [(0.5, 3.0), (1.0, 1.0)]
    write_checkpoint(tmp_path / "bad", edit=lambda t: t.__setitem__("language_model.model.layers.1.self_attn.k_scale",
                                                                     torch.tensor([-1.0])))
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.k_scale: expected one positive float"):
        load_model(tmp_path / "bad")
