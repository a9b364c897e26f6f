"""The attention block's flagged handoffs (kernels/flags.py, opt-in by MINIMAX_OPS_FLAGGED_HANDOFF): the score pass's
scores and the splits' partials as int64 words tagged with the layer call's epoch, polled by their consumers
instead of a grid wait.

The kernels run here without PDL (on CPU under the interpreter; a consumer then finds every word written and
polls once): the tagged words, the values they carry and the input norm's epoch bump. The fused layer running
each form as programmatic dependents on a GPU is tests/test_gpu.py's.
"""

from __future__ import annotations

import pytest
import torch

from minimax_ops.cache import build_step
from minimax_ops.config import preset
from minimax_ops.kernels import attention, flags, index_topk, norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = preset("tiny")
H, KVH, D = CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim
BS, TOPK = CFG.sparse_block_size, CFG.sparse_topk_blocks
HI, DI = CFG.sparse_num_index_heads, CFG.sparse_index_dim
NUM_BLOCKS = 40


def one_token_step(context: int, seed: int):
    """A one-token step at ``context`` with random caches (every position written), q and index q."""
    gen = torch.Generator().manual_seed(seed)
    meta = build_step([context], 1, block_size=BS, num_blocks=NUM_BLOCKS, generator=gen).to(DEVICE)
    kv = torch.randn(NUM_BLOCKS, KVH, BS, 2 * D, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    index = torch.randn(NUM_BLOCKS, BS, DI, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    q = torch.randn(1, H, D, generator=gen).bfloat16().to(DEVICE)
    index_q = torch.randn(1, HI, DI, generator=gen).bfloat16().to(DEVICE)
    return meta, kv, index, q, index_q


def tag_of(epoch: torch.Tensor) -> int:
    return flags.TAG.value | (int(epoch.item()) & flags.EPOCH_MASK.value)


@pytest.mark.parametrize("context", [37, 5 * BS + 3, 2 * BS])
def test_flagged_scores_and_partials_carry_the_values_and_the_tag(context):
    """index_scores with an epoch writes, for every block of the row, a word whose low half is the score's bits
    and whose high half is the epoch's tag; the attention reading them (the splits polling the scores; with
    flag_partials the merge polling the splits' partials too) gives the unflagged form's output bit for bit, with
    one split and with several."""
    meta, kv, index, q, index_q = one_token_step(context, seed=context)
    args = (meta.block_table, meta.seq_lens)
    epoch = torch.full((1,), 12345, dtype=torch.int32, device=DEVICE)
    plain = index_topk.index_scores(index_q, index, *args, 1)
    words = index_topk.index_scores(index_q, index, *args, 1, epoch=epoch)
    assert words.dtype == torch.int64 and words.shape == plain.shape
    nb = -(-context // BS)
    assert ((words[..., :nb] >> 32) == tag_of(epoch)).all()
    low = (words[..., :nb] & 0xFFFFFFFF).to(torch.int32)
    assert torch.equal(low.view(torch.float32), plain[..., :nb])
    for splits in (1, 3, None):
        want = attention.index_sparse_attention_decode(q, plain, kv, *args, 1, TOPK, num_splits=splits)
        assert want.float().abs().amax() > 0
        for flag_partials in (False, True):
            got = attention.index_sparse_attention_decode(q, words, kv, *args, 1, TOPK, num_splits=splits,
                                                          epoch=epoch, flag_partials=flag_partials)
            assert torch.equal(got, want), (splits, flag_partials)


def test_input_norm_bumps_the_epoch_once_a_call_with_the_same_bits():
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(1, 96, generator=gen).bfloat16().to(DEVICE) for _ in range(2))
    weight = (torch.randn(96, generator=gen) * 0.3).bfloat16().to(DEVICE)
    epoch = torch.full((1,), 7, dtype=torch.int32, device=DEVICE)
    want = norm.add_rmsnorm(x, residual, weight, 1e-6)
    for expected in (8, 9):
        got = norm.add_rmsnorm(x, residual, weight, 1e-6, epoch=epoch)
        assert int(epoch.item()) == expected
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_flagged_handoff_rejects_bad_arguments(monkeypatch):
    meta, kv, index, q, index_q = one_token_step(37, seed=1)
    args = (meta.block_table, meta.seq_lens)
    scores = index_topk.index_scores(index_q, index, *args, 1)
    with pytest.raises(ValueError, match="epoch: expected flags.epoch's int32"):
        index_topk.index_scores(index_q, index, *args, 1, epoch=torch.zeros(1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"scores: expected an int64 \(flagged\)"):
        attention.index_sparse_attention_decode(q, scores, kv, *args, 1, TOPK,
                                                epoch=torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="flag_partials: needs epoch"):
        attention.index_sparse_attention_decode(q, scores, kv, *args, 1, TOPK, flag_partials=True)
    from minimax_ops.kernels import decode_layer
    monkeypatch.setenv("MINIMAX_OPS_FLAGGED_HANDOFF", "3")
    with pytest.raises(ValueError, match="MINIMAX_OPS_FLAGGED_HANDOFF: expected 0, 1 or 2"):
        decode_layer.kernel_stages().index_sparse_attention(q, index_q, kv, index, *args, 1, TOPK, 1.0, 1.0)


def test_specs_of_the_flagged_forms_are_cuda_only():
    """The flagged forms run only as programmatic dependents: CUDA-only AOT specs, with int64 word pointers."""
    specs = [s for m in (attention, index_topk, norm) for s in m.aot_specs()
             if s.constexprs.get("FLAG") or s.constexprs.get("BUMP")]
    kernels = {s.kernel.__name__ for s in specs}
    assert kernels == {"_attention_split_kernel", "_attention_merge_kernel", "_index_score_kernel", "_rmsnorm_kernel"}
    assert all(s.targets == ("cuda",) and s.constexprs["PDL"] for s in specs)
    assert {s.constexprs.get("FLAG") for s in specs if s.kernel is attention._attention_split_kernel} == {1, 2}
    for s in specs:
        words = [name for name, t in s.signature.items() if t == "*i64"]
        assert words == {"_attention_split_kernel": ["select_ptr"] + (["part_acc_ptr", "part_ml_ptr"]
                                                                      if s.constexprs.get("FLAG") == 2 else []),
                         "_attention_merge_kernel": ["part_acc_ptr", "part_ml_ptr"],
                         "_index_score_kernel": ["scores_ptr"], "_rmsnorm_kernel": []}[s.kernel.__name__], s.label()
