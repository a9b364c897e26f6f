"""A tiny random MiniMax-M3 checkpoint laid out as the official release: the vision-language model's
config.json (model_type minimax_m3_vl, the text model under text_config, the release's field names) and
safetensors with the release's tensor names, the text model under ``language_model.`` beside vision
tower, projector and MTP tensors. Shared by the vLLM engine tests and the loader tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from minimax_ops.config import MiniMaxM3Config
from minimax_ops.loader import checkpoint_tensors
from minimax_ops.weights import ModelWeights, random_model_weights

ARCH = "MiniMaxM3SparseForConditionalGeneration"
# 2 dense + 2 sparse MoE layers; head_dim and block size as the real model (128); top-2 of the blocks
# so that prompts of several blocks make selection matter.
TINY = MiniMaxM3Config(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=128, rotary_dim=64, max_position_embeddings=4096, dense_intermediate_size=64, intermediate_size=32,
    shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, moe_layer_freq=(0, 0, 1, 1),
    sparse_attention_freq=(0, 0, 1, 1), sparse_block_size=128, sparse_topk_blocks=2, sparse_num_index_heads=2,
    sparse_index_dim=128)

# Parts of the VL release the text decoder does not use (names as the release spells them).
NON_TEXT = {"vision_tower.patch_embed.proj.weight": (8, 3, 2, 2), "multi_modal_projector.linear_1.weight": (8, 8),
            "language_model.model.mtp.layers.0.eh_proj.weight": (64, 128)}


def release_config(config: MiniMaxM3Config = TINY) -> dict:
    text = {**config.to_hf_dict(), "model_type": "minimax_m3_text", "hidden_act": "swigluoai"}
    text.pop("architectures")
    return {"architectures": [ARCH], "model_type": "minimax_m3_vl", "text_config": text,
            "vision_config": {"hidden_size": 8}, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def write_checkpoint(path: Path, config: MiniMaxM3Config = TINY, seed: int = 0, weights: ModelWeights | None = None,
                     edit=None) -> ModelWeights:
    """Write config.json and model.safetensors; ``edit(tensors)`` may alter the named tensors first
    (bad-checkpoint tests). Returns the weights written."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = weights or random_model_weights(config, generator=gen)
    tensors = {"language_model." + k: v for k, v in checkpoint_tensors(weights, config).items()}
    for name, shape in NON_TEXT.items():
        tensors[name] = torch.randn(shape, generator=gen).to(torch.bfloat16)
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(release_config(config), indent=2))
    return weights


# How far bf16 activations move a logit between implementations (and between CPUs' kernels: ~1e-2).
LOGIT_NOISE = 0.05


def _reference_steps(weights: ModelWeights, config: MiniMaxM3Config, prompt: list[int], max_tokens: int, choose):
    """The project's pure-PyTorch reference model decoding after ``prompt`` (one prefill, then one-token
    steps): yields each step's last-position logits; ``choose(step, logits)`` gives the token fed next."""
    from minimax_ops.cache import allocate_caches, build_step
    from minimax_ops.reference_model import model_forward

    bs = config.sparse_block_size
    num_blocks = -(-(len(prompt) + max_tokens) // bs)
    caches = allocate_caches(config, num_blocks, fill="zeros")
    ids = [list(range(num_blocks))]
    context, step = 0, list(prompt)
    for i in range(max_tokens):
        meta = build_step([context], [len(step)], block_size=bs, num_blocks=num_blocks, block_ids=ids,
                          table_width=num_blocks)
        logits = model_forward(torch.tensor(step), weights, caches, meta, config)[-1]
        yield logits
        context += len(step)
        step = [choose(i, logits)]


def reference_greedy_margin(weights: ModelWeights, config: MiniMaxM3Config, prompt: list[int],
                            max_tokens: int) -> tuple[list[int], float]:
    """(greedy tokens, the smallest gap between the best and second-best logit over the steps): a
    gap within bf16 noise makes the greedy choice itself a coin toss between implementations."""
    out, margin = [], float("inf")
    for logits in _reference_steps(weights, config, prompt, max_tokens, lambda _, logits: int(logits.argmax())):
        top = logits.topk(2).values
        margin = min(margin, float(top[0] - top[1]))
        out.append(int(logits.argmax()))
    return out, margin


def assert_greedy(prompt: list[int], tokens: list[int], step_logits, source: str, noise: float = LOGIT_NOISE) -> None:
    """Every one of ``tokens`` (an implementation's greedy output after ``prompt``) is ``source``'s greedy
    choice given the tokens before it, or short of its best logit by at most ``noise``: a near-tie (or,
    in bf16 logits, a tie) that rounding may tip either way. ``step_logits`` yields ``source``'s logits at
    each step as it follows ``tokens`` (teacher forcing), so each step is checked after a tipped tie too;
    where its top two are further apart than ``noise``, only its own choice passes."""
    steps = 0
    for i, logits in enumerate(step_logits):
        logits = logits.float()
        best = int(logits.argmax())
        short = float(logits[best] - logits[tokens[i]])
        assert short <= noise, (f"prompt of {len(prompt)} tokens, step {i}: token {tokens[i]}'s logit is {short:.4f} "
                                f"below {source}'s choice {best} (noise allowed: {noise}); tokens {tokens}")
        steps += 1
    assert steps == len(tokens), f"{source} gave logits for {steps} of {len(tokens)} steps"


def assert_reference_greedy(weights: ModelWeights, config: MiniMaxM3Config, prompt: list[int], tokens: list[int],
                            noise: float = LOGIT_NOISE) -> None:
    """assert_greedy against the project's reference model."""
    steps = _reference_steps(weights, config, prompt, len(tokens), lambda i, _: tokens[i])
    assert_greedy(prompt, tokens, steps, "the reference", noise)


def decisive_prompts(weights: ModelWeights, config: MiniMaxM3Config, lens, max_tokens: int, seed: int,
                     min_margin: float = LOGIT_NOISE) -> list[tuple[list[int], list[int]]]:
    """(prompt, reference tokens) per length, drawing prompts until every greedy step's top-2 logit gap
    is at least min_margin, beyond the noise between implementations."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lens:
        for _ in range(20):
            prompt = torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
            tokens, margin = reference_greedy_margin(weights, config, prompt, max_tokens)
            if margin >= min_margin:
                out.append((prompt, tokens))
                break
        else:
            raise AssertionError(f"no prompt of {n} tokens with a decisive greedy path in 20 draws")
    return out
