"""transformers' own MiniMax-M3 (models/minimax_m3_vl, MiniMaxM3VLForCausalLM) as a second, independent
reference for a checkpoint: its config built from the transformers form of the text config, its weights
mapped explicitly from the release's tensor names (its save_pretrained names differ)."""

from __future__ import annotations

import torch

from minimax_ops.config import MiniMaxM3Config


def transformers_state_dict(tensors: dict[str, torch.Tensor], config: MiniMaxM3Config) -> dict[str, torch.Tensor]:
    """Release (text-model) names -> MiniMaxM3VLForCausalLM's: index projections under the indexer,
    gate and up rows fused, routed experts stacked, the router and its bias under mlp.gate."""
    out = {k: tensors[k] for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    cat = lambda *names: torch.cat([tensors[n] for n in names])  # noqa: E731
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm"):
            out[f"{p}{name}.weight"] = tensors[f"{p}{name}.weight"]
        if not config.moe_layer_freq[i]:
            out[p + "mlp.gate_up_proj.weight"] = cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            out[p + "mlp.down_proj.weight"] = tensors[p + "mlp.down_proj.weight"]
            continue
        for ours, theirs in (("index_q_proj", "q_proj"), ("index_k_proj", "k_proj"), ("index_q_norm", "q_norm"),
                             ("index_k_norm", "k_norm")):
            out[f"{p}self_attn.indexer.{theirs}.weight"] = tensors[f"{p}self_attn.{ours}.weight"]
        moe = p + "block_sparse_moe."
        out[p + "mlp.gate.weight"] = tensors[moe + "gate.weight"]
        out[p + "mlp.gate.e_score_correction_bias"] = tensors[moe + "e_score_correction_bias"]
        experts = range(config.num_local_experts)
        out[p + "mlp.experts.gate_up_proj"] = torch.stack(
            [cat(f"{moe}experts.{e}.w1.weight", f"{moe}experts.{e}.w3.weight") for e in experts])
        out[p + "mlp.experts.down_proj"] = torch.stack([tensors[f"{moe}experts.{e}.w2.weight"] for e in experts])
        out[p + "mlp.shared_experts.gate_up_proj.weight"] = cat(moe + "shared_experts.gate_proj.weight",
                                                               moe + "shared_experts.up_proj.weight")
        out[p + "mlp.shared_experts.down_proj.weight"] = tensors[moe + "shared_experts.down_proj.weight"]
    return out


def transformers_steps(tensors: dict[str, torch.Tensor], config: MiniMaxM3Config, text_config: dict,
                       prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """transformers' MiniMaxM3VLForCausalLM (bf16) decoding ``tokens`` after ``prompt`` as its greedy search
    does (a prefill, then one-token steps on its KV cache), fed ``tokens`` (teacher forcing): its logits at
    each step (bf16, as its lm_head gives them)."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

    fields = {k: v for k, v in text_config.items() if k != "model_type"}
    model = MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**fields, bos_token_id=None, eos_token_id=None))
    state = {k: v.float() for k, v in transformers_state_dict(tensors, config).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise AssertionError(f"transformers' model: missing {missing}, unexpected {unexpected}")
    model = model.to(torch.bfloat16).eval()
    steps = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for i, token in enumerate(tokens):
            steps.append(out.logits[0, -1])
            if i + 1 < len(tokens):  # (the last token's own logits are not asked for)
                out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return steps
