"""MiniMaxM3ForVllm: the class vLLM's model registry builds for MiniMax-M3's architectures (plugin.py).

- Config: the text config of vLLM's hf_config, read by MiniMaxM3Config.from_hf_dict (either
  config.json form; an unsupported field raises ConfigError naming it, at engine start).
- Weights: ``load_weights`` takes vLLM's (name, tensor) stream of a Hugging Face checkpoint (text model,
  or the VL release with its text model under ``language_model.``), maps it through loader.py (fused
  and re-laid for the ops; a missing, extra, mis-shaped or mistyped tensor raises CheckpointError
  naming it) and only then builds the compiled module (compiled.py), whose parameters are the
  loaded tensors.
- Caches: one MiniMaxM3CacheLayer per cache (attention.py); vLLM allocates and binds them.
- Parallelism: under tensor parallelism ``load_weights`` keeps this rank's shard (sharding.py, vLLM's TP
  rank and size) and the caches hold its kv heads; the all-reduces go through vLLM's TP group. Under
  pipeline parallelism the model holds vLLM's split of the layers (``get_pp_indices``) and passes
  (hidden_states, residual) between stages as IntermediateTensors.
- Steps: ``forward`` turns vLLM's attention metadata into a StepMetadata (attention.step_from_vllm)
  and makes it the current step for the ops; a run without attention metadata (vLLM's profiling and
  warm-up dummy runs) runs an idle step that touches no cache, or, before the caches exist, skips the
  decoder and returns zeros of the right shape.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank
from vllm.distributed.utils import get_pp_indices
from vllm.forward_context import get_forward_context
from vllm.sequence import IntermediateTensors

from graph_passes.fused_decode_pass import MiniMaxM3DecodePass
from minimax_ops.config import SPARSE_MOE
from minimax_ops.loader import kv_scales, text_model_tensors, weights_from_tensors
from minimax_ops.log import log_once
from minimax_ops.sharding import local_config
from minimax_ops.step_context import use_step
from minimax_ops.weights import model_to_kernel_layout

from .attention import MiniMaxM3CacheLayer, idle_step, step_from_vllm
from .compiled import MiniMaxM3VllmModel, cache_dtype
from .deployment import deployment_from_vllm_config, minimax_m3_config_from_vllm


def pass_off_reason(vllm_config: VllmConfig) -> str | None:
    """Why the fused decode pass will not run in this engine, or None."""
    from vllm.config import CompilationMode

    compilation = vllm_config.compilation_config
    if compilation.mode == CompilationMode.NONE:
        return ("vLLM's compilation mode is NONE (enforce_eager, -O0 or VLLM_USE_BREAKABLE_CUDAGRAPH=1): the model "
                "runs the unfused ops eagerly")
    graph_pass = (compilation.inductor_compile_config or {}).get("post_grad_custom_post_pass")
    if not isinstance(graph_pass, MiniMaxM3DecodePass):
        return ("compilation_config names no MiniMaxM3DecodePass as post_grad_custom_post_pass (add "
                "inductor_passes={'post_grad_custom_post_pass': 'graph_passes.minimax_m3_decode_pass'}): "
                "decode layers stay unfused")
    return None


class MiniMaxM3ForVllm(nn.Module):
    """vLLM model interface: forward(input_ids, positions, intermediate_tensors) -> hidden states (or
    IntermediateTensors before the last pipeline stage), compute_logits, embed_input_ids, load_weights,
    make_empty_intermediate_tensors."""

    supports_pp = True  # vLLM's SupportsPP

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = minimax_m3_config_from_vllm(vllm_config)
        if config is None:
            raise ValueError("model_config.hf_config: expected a MiniMax-M3 config (model_type minimax_m3_vl / "
                             f"minimax_m3_text or a MiniMaxM3 architecture), got "
                             f"{getattr(vllm_config.model_config, 'hf_config', None)!r}")
        self.vllm_config, self.config = vllm_config, config
        deployment = deployment_from_vllm_config(vllm_config, config)
        reason = pass_off_reason(vllm_config)
        if reason is not None:
            log_once(f"fused decode off: {reason}")
        block = vllm_config.cache_config.block_size
        if block != config.sparse_block_size:
            raise ValueError(f"cache_config.block_size: MiniMax-M3's sparse attention needs blocks of "
                             f"{config.sparse_block_size} tokens (--block-size {config.sparse_block_size}), got {block}")
        kv_dtype, index_dtype = cache_dtype(deployment, "kv"), cache_dtype(deployment, "index")
        layers = config.num_hidden_layers
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        kv_heads = local_config(config, self.tp_size).num_key_value_heads  # this rank's (a ShardingError names why not)
        # vLLM's groups exist only where it runs distributed; one stage holds every layer.
        pp_rank, pp_size = 0, vllm_config.parallel_config.pipeline_parallel_size
        if pp_size > 1:
            pp_rank = get_pp_group().rank_in_group
        self.layer_range = range(*get_pp_indices(layers, pp_rank, pp_size))
        self.is_first_stage, self.is_last_stage = pp_rank == 0, pp_rank == pp_size - 1
        base = f"{prefix}." if prefix else ""
        # Distinct integers in the names: vLLM orders caches by the one integer in each name.
        self.kv_layers = nn.ModuleList(
            MiniMaxM3CacheLayer(f"{base}kv_caches.{i}", "kv", kv_heads, config.head_dim, kv_dtype, block)
            for i in self.layer_range)
        self.index_layers = nn.ModuleList(
            MiniMaxM3CacheLayer(f"{base}index_caches.{layers + i}", "index", 1, config.sparse_index_dim, index_dtype,
                                block) for i in self.layer_range if config.layer_kind(i) == SPARSE_MOE)
        self.text: MiniMaxM3VllmModel | None = None  # built by load_weights

    # ---- weights ------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tensors = text_model_tensors(dict(weights))
        device = self.vllm_config.device_config.device
        model_weights = weights_from_tensors(tensors, self.config, device=device,
                                             tp_rank=get_tensor_model_parallel_rank() if self.tp_size > 1 else 0,
                                             tp_size=self.tp_size,
                                             layers=self.layer_range)
        # re-laid once for the kernels (MXFP4 words; mxfp4_mma experts where its PTX kernels run)
        model_weights = model_to_kernel_layout(model_weights)
        with set_current_vllm_config(self.vllm_config):
            self.text = MiniMaxM3VllmModel(vllm_config=self.vllm_config, config=self.config, weights=model_weights,
                                           layers=self.layer_range)
        scales = kv_scales(tensors, self.config)[self.layer_range.start:]  # per layer, replicated under TP
        for layer, (k_scale, v_scale) in zip(self.text.model.model.layers, scales):
            layer.k_scale, layer.v_scale = k_scale, v_scale  # compile-time constants of each layer's ops
        return {name for name, _ in self.named_parameters()}

    # ---- steps --------------------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text.model.model.embed_tokens(input_ids)

    def make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype,
                                        device: torch.device) -> IntermediateTensors:
        """What a stage after the first receives: the previous stage's hidden states and residual."""
        return IntermediateTensors({name: torch.zeros(batch_size, self.config.hidden_size, dtype=torch.bfloat16,
                                                      device=device) for name in ("hidden_states", "residual")})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor | IntermediateTensors:
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds: MiniMaxM3ForVllm takes token ids")
        if (intermediate_tensors is None) != self.is_first_stage:
            raise ValueError(f"intermediate_tensors: expected them exactly on pipeline stages after the first "
                             f"(this stage holds layers {self.layer_range}), got {intermediate_tensors!r}")
        attn = get_forward_context().attn_metadata
        if isinstance(attn, list):  # micro-batched steps are not supported (one metadata dict per step)
            raise ValueError("attn_metadata: micro-batching (ubatching) is not supported by MiniMaxM3ForVllm")
        if not attn:  # a dummy run (profiling, warm-up)
            if self.kv_layers[0].kv_cache.dim() != 4:  # before vLLM allocated the caches: nothing to run
                empty = self.make_empty_intermediate_tensors(input_ids.shape[0], torch.bfloat16, input_ids.device)
                return empty["hidden_states"] if self.is_last_stage else empty
            step = idle_step(positions, self.text.table_width, input_ids.device)  # compiles at its size
        else:
            index = attn[self.index_layers[0].layer_name] if len(self.index_layers) else None
            step = step_from_vllm(attn[self.kv_layers[0].layer_name], index, positions, self.text.table_width)
        # The config is current while the module compiles (the decode pass reads the deployment from it;
        # vLLM's trace-once mode compiles here without setting it).
        with use_step(step), set_current_vllm_config(self.vllm_config):
            out = self.text(input_ids, positions, step.slot_mapping, step.index_slot_mapping, step.block_table,
                            step.seq_lens, [layer.cache() for layer in self.kv_layers],
                            [layer.cache() for layer in self.index_layers], intermediate_tensors)
        return out if self.is_last_stage else IntermediateTensors(dict(out))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.text.model.logits(hidden_states)
