"""MiniMaxM3ForVllm without an engine: built from a real VllmConfig of the tiny VL-layout checkpoint,
its weights loaded the way vLLM's loader hands them over ((name, tensor) pairs). Bad checkpoints fail at
load with the tensor named; a configuration in which the pass cannot run says why on the minimax_ops log."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import minimax_reasons
from minimax_ops.loader import CheckpointError
from vllm_checkpoint import TINY, write_checkpoint
from vllm_support import require_vllm

PASS = "graph_passes.minimax_m3_decode_pass"


def build(path, **compilation):
    require_vllm()
    from vllm.config import (CacheConfig, CompilationConfig, DeviceConfig, ModelConfig, VllmConfig,
                             set_current_vllm_config)

    from minimax_vllm.model import MiniMaxM3ForVllm
    from minimax_vllm.plugin import register

    register()
    config = VllmConfig(model_config=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="bfloat16"),
                        cache_config=CacheConfig(block_size=compilation.pop("block_size", 128)),
                        device_config=DeviceConfig(device="cpu"), compilation_config=CompilationConfig(**compilation))
    with set_current_vllm_config(config):
        return MiniMaxM3ForVllm(vllm_config=config)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm_model") / "ckpt"
    write_checkpoint(path)
    return path


def test_load_weights_reads_the_vl_release_and_reports_every_parameter(checkpoint):
    model = build(checkpoint, mode=3, inductor_passes={"post_grad_custom_post_pass": PASS})
    loaded = model.load_weights(load_file(str(checkpoint / "model.safetensors")).items())
    assert loaded == {name for name, _ in model.named_parameters()} and loaded
    assert model.text.model.model.layers[2].gate.dtype == torch.float32
    assert [layer.kind for layer in model.kv_layers] == ["kv"] * TINY.num_hidden_layers
    assert len(model.index_layers) == 2  # one index cache per sparse layer


@pytest.mark.parametrize("edit,fragment", [
    (lambda t: t.pop("language_model.model.layers.3.block_sparse_moe.experts.1.w2.weight"),
     "missing tensor 'model.layers.3.block_sparse_moe.experts.1.w2.weight'"),
    (lambda t: t.__setitem__("language_model.model.embed_tokens.weight", torch.zeros(256, 32, dtype=torch.bfloat16)),
     "model.embed_tokens.weight: expected shape (256, 64), got (256, 32)"),
    (lambda t: t.__setitem__("language_model.lm_head.weight", torch.zeros(256, 64, dtype=torch.float16)),
     "lm_head.weight: expected dtype torch.bfloat16, got torch.float16"),
], ids=["missing", "shape", "dtype"])
def test_bad_checkpoints_fail_in_load_weights_with_the_tensor_named(tmp_path, checkpoint, edit, fragment):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    edit(tensors)
    model = build(checkpoint, mode=3)
    with pytest.raises(CheckpointError) as info:
        model.load_weights(tensors.items())
    assert fragment in str(info.value)


@pytest.mark.parametrize("compilation,fragment", [
    ({"mode": 0}, "fused decode off: vLLM's compilation mode is NONE"),
    ({"mode": 3}, "fused decode off: compilation_config names no MiniMaxM3DecodePass"),
], ids=["mode-none", "no-pass"])
def test_a_pass_that_cannot_run_is_logged(checkpoint, minimax_log, compilation, fragment):
    build(checkpoint, **compilation)
    assert any(fragment in r for r in minimax_reasons(minimax_log)), minimax_reasons(minimax_log)


def test_a_block_size_other_than_the_sparse_block_is_refused_at_construction(checkpoint):
    with pytest.raises(ValueError, match="cache_config.block_size: MiniMax-M3's sparse attention needs blocks of 128"):
        build(checkpoint, block_size=64, mode=3)


def _metadata(query_lens, seq_lens, table, slots):
    from types import SimpleNamespace

    from minimax_vllm.attention import MiniMaxM3AttentionMetadata

    common = SimpleNamespace(slot_mapping=slots, block_table_tensor=table, seq_lens=seq_lens, num_reqs=len(query_lens))
    return MiniMaxM3AttentionMetadata(common, tuple(query_lens))


def test_step_metadata_from_vllm_and_the_refusal_when_the_caches_do_not_share_blocks(minimax_log):
    require_vllm()
    from minimax_vllm.attention import step_from_vllm

    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    seq_lens = torch.tensor([130, 7], dtype=torch.int32)
    slots = torch.tensor([3 * 128 + 1, 7], dtype=torch.int64)
    positions = torch.tensor([129, 6])
    main = _metadata([1, 1], seq_lens, table, slots)
    step = step_from_vllm(main, _metadata([1, 1], seq_lens, table, slots), positions, 2)
    assert step.query_len == 1 and step.num_prefills == 0 and torch.equal(step.block_table, table)
    assert step.block_table.data_ptr() == table.data_ptr()  # a view of vLLM's table, not a copy
    assert torch.equal(step.index_slot_mapping, slots)
    # Tokens the requests do not cover (padding): never a uniform decode, padding rows write nothing.
    padded = step_from_vllm(main, None, torch.tensor([129, 6, 0]), 2)
    assert padded.num_prefills == 1 and padded.slot_mapping.tolist()[-1] == -1
    other = _metadata([1, 1], seq_lens, table.clone(), slots)  # the index cache in its own cache group
    with pytest.raises(RuntimeError, match="index cache its own cache group"):
        step_from_vllm(main, other, positions, 2)
    assert any("index cache its own cache group" in r for r in minimax_reasons(minimax_log))
