"""MiniMaxM3Config: the text decoder's hyper-parameters, read from a HuggingFace config.json dict.

Field names are the checkpoint's own (``hidden_size``, ``num_local_experts``, the
``sparse_attention_config`` sub-dict, per-layer ``moe_layer_freq`` flags, ...). A top-level
multimodal config with the text model under ``text_config`` is accepted too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .constants import MX_BLOCK

DENSE = "dense"
SPARSE_MOE = "sparse_moe"


class ConfigError(ValueError):
    """A config.json field is missing, mistyped or outside what the model supports."""


@dataclass(frozen=True)
class MiniMaxM3Config:
    vocab_size: int = 200064
    hidden_size: int = 6144
    num_hidden_layers: int = 60
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    rotary_dim: int = 64
    hidden_act: str = "swigluoai"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    dense_intermediate_size: int = 12288
    intermediate_size: int = 3072  # per routed expert
    shared_intermediate_size: int = 3072
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    scoring_func: str = "sigmoid"
    use_routing_bias: bool = True
    routed_scaling_factor: float = 2.0
    use_qk_norm: bool = True
    qk_norm_type: str = "per_head"
    tie_word_embeddings: bool = False
    # Per layer: 1 = MoE FFN / block-sparse attention, 0 = dense MLP / full attention.
    moe_layer_freq: tuple[int, ...] = field(default_factory=lambda: (0,) * 3 + (1,) * 57)
    sparse_attention_freq: tuple[int, ...] = field(default_factory=lambda: (0,) * 3 + (1,) * 57)
    sparse_block_size: int = 128
    sparse_topk_blocks: int = 16
    sparse_num_index_heads: int = 4
    sparse_index_dim: int = 128
    sparse_init_block: int = 0
    sparse_local_block: int = 1
    sparse_score_type: str = "max"

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived sizes -------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def index_q_size(self) -> int:
        return self.sparse_num_index_heads * self.sparse_index_dim

    def qkv_size(self, layer: int) -> int:
        """Width of the fused projection [q | k | v (| index_q | index_k)] of a layer."""
        width = self.q_size + 2 * self.kv_size
        if self.layer_kind(layer) == SPARSE_MOE:
            width += self.index_q_size + self.sparse_index_dim
        return width

    def layer_kind(self, layer: int) -> str:
        if not 0 <= layer < self.num_hidden_layers:
            raise ConfigError(f"layer index {layer} outside 0..{self.num_hidden_layers - 1}")
        return SPARSE_MOE if self.moe_layer_freq[layer] else DENSE

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_hidden_layers))

    @property
    def num_dense_prefix(self) -> int:
        kinds = self.layer_kinds
        return next((i for i, k in enumerate(kinds) if k == SPARSE_MOE), len(kinds))

    # ---- validation ------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"config field '{name}': {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "dense_intermediate_size",
                     "intermediate_size", "num_local_experts", "num_experts_per_tok",
                     "sparse_block_size", "sparse_topk_blocks", "sparse_num_index_heads",
                     "sparse_index_dim", "max_position_embeddings"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
                 f"expected a positive integer, got {value!r}")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_attention_heads",
             f"must be a multiple of num_key_value_heads={self.num_key_value_heads}, "
             f"got {self.num_attention_heads}")
        need(0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0, "rotary_dim",
             f"expected an even number in 2..head_dim={self.head_dim}, got {self.rotary_dim}")
        need(self.hidden_act in ("swigluoai", "swiglu_oai"), "hidden_act",
             f"expected 'swigluoai', got {self.hidden_act!r}")
        need(self.scoring_func == "sigmoid", "scoring_func",
             f"expected 'sigmoid', got {self.scoring_func!r}")
        need(self.num_experts_per_tok <= self.num_local_experts, "num_experts_per_tok",
             f"must be <= num_local_experts={self.num_local_experts}, got {self.num_experts_per_tok}")
        need(self.n_shared_experts in (0, 1), "n_shared_experts",
             f"expected 0 or 1, got {self.n_shared_experts}")
        need(self.use_qk_norm and self.qk_norm_type == "per_head", "qk_norm_type",
             f"expected per-head qk norm, got use_qk_norm={self.use_qk_norm}, "
             f"qk_norm_type={self.qk_norm_type!r}")
        for name in ("hidden_size", "intermediate_size", "shared_intermediate_size",
                     "dense_intermediate_size"):
            value = getattr(self, name)
            need(value % MX_BLOCK == 0, name, f"must be a multiple of {MX_BLOCK} (MX block), got {value}")
        need(self.q_size % MX_BLOCK == 0, "num_attention_heads",
             f"heads*head_dim must be a multiple of {MX_BLOCK}, got {self.q_size}")
        for name in ("moe_layer_freq", "sparse_attention_freq"):
            flags = getattr(self, name)
            need(len(flags) == self.num_hidden_layers and all(f in (0, 1) for f in flags), name,
                 f"expected {self.num_hidden_layers} flags of 0/1, got {list(flags)}")
        for i, (moe, sparse) in enumerate(zip(self.moe_layer_freq, self.sparse_attention_freq)):
            need(moe == sparse, "sparse_attention_freq",
                 f"layer {i} has moe={moe} but sparse attention={sparse}; only dense+full-attention "
                 "and MoE+sparse-attention layers exist in MiniMax-M3")
        if any(self.moe_layer_freq):
            need(self.sparse_num_index_heads == self.num_key_value_heads,
                 "sparse_attention_config.sparse_num_index_heads",
                 f"must equal num_key_value_heads={self.num_key_value_heads} (index head h serves "
                 f"kv head h), got {self.sparse_num_index_heads}")
            need(self.sparse_index_dim == self.head_dim, "sparse_attention_config.sparse_index_dim",
                 f"must equal head_dim={self.head_dim}, got {self.sparse_index_dim}")
            need(self.sparse_init_block == 0, "sparse_attention_config.sparse_init_block",
                 f"only 0 init blocks are supported, got {self.sparse_init_block}")
            need(self.sparse_local_block == 1, "sparse_attention_config.sparse_local_block",
                 f"only 1 local block is supported, got {self.sparse_local_block}")
            need(self.sparse_score_type == "max", "sparse_attention_config.sparse_score_type",
                 f"only 'max' block scores are supported, got {self.sparse_score_type!r}")

    # ---- HuggingFace config.json ---------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, config: dict[str, Any]) -> "MiniMaxM3Config":
        """Either config.json form: the release's (``moe_layer_freq``, ``sparse_attention_config``,
        top-level ``rope_theta``) or the one transformers' ``save_pretrained`` writes
        (``layer_types`` / ``mlp_layer_types``, flat ``index_*``, ``rope_parameters``,
        ``partial_rotary_factor``). A field given in both forms must agree (ConfigError otherwise)."""
        if not isinstance(config, dict):
            raise ConfigError(f"expected a config.json dict, got {type(config).__name__}")
        text = config.get("text_config") or config
        release = _release_form(text, cls)
        hf = _transformers_form(text, cls)
        kwargs: dict[str, Any] = {k: v for k, v in text.items() if k in {f.name for f in dataclasses.fields(cls)}}
        if hf and "hidden_act" in kwargs and kwargs["hidden_act"] == "silu":
            # transformers rewrites the release's "swigluoai" to "silu" and computes SwiGLU-OAI from
            # swiglu_alpha / swiglu_limit regardless; in that form "silu" means the same activation.
            kwargs["hidden_act"] = "swigluoai"
        for key in set(release) & set(hf):
            if release[key] != hf[key]:
                raise ConfigError(f"config field '{key}': the release form says {release[key]!r}, the transformers "
                                  f"form says {hf[key]!r}; a config.json must not disagree with itself")
        for source in (release, hf):
            for key, value in source.items():
                if key in kwargs and key in ("rotary_dim", "rope_theta") and kwargs[key] != value:
                    raise ConfigError(f"config field '{key}': {kwargs[key]!r} disagrees with {value!r} derived from "
                                      "partial_rotary_factor / rope_parameters")
                kwargs[key] = value
        layers = int(kwargs.get("num_hidden_layers", cls.num_hidden_layers))
        for key in ("moe_layer_freq", "sparse_attention_freq"):
            if key not in kwargs:  # neither form names the layer pattern: the real model's
                kwargs[key] = (0,) * min(3, layers) + (1,) * max(0, layers - 3)
        for key in ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit"):
            if key in kwargs:
                kwargs[key] = float(kwargs[key])
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        sparse = {k: out.pop(k) for k in list(out) if k.startswith("sparse_") and k != "sparse_attention_freq"}
        sparse["sparse_attention_freq"] = list(out.pop("sparse_attention_freq"))
        sparse["use_sparse_attention"] = True
        out["moe_layer_freq"] = list(out["moe_layer_freq"])
        out["sparse_attention_config"] = sparse
        out["architectures"] = ["MiniMaxM3SparseForCausalLM"]
        return out

    def replace(self, **changes: Any) -> "MiniMaxM3Config":
        return dataclasses.replace(self, **changes)



SPARSE_KEYS = ("sparse_block_size", "sparse_topk_blocks", "sparse_num_index_heads", "sparse_index_dim",
               "sparse_init_block", "sparse_local_block", "sparse_score_type")
# transformers' flat names for the release's sparse_attention_config entries
TRANSFORMERS_INDEX_KEYS = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
                           "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
                           "index_local_blocks": "sparse_local_block"}
ATTENTION_LAYER_TYPES = {"full_attention": 0, "minimax_m3_sparse": 1}
MLP_LAYER_TYPES = {"dense": 0, "sparse": 1}


def _release_form(text: dict[str, Any], cls) -> dict[str, Any]:
    """Fields of the release's config.json form (sparse_attention_config, per-layer flag lists)."""
    sparse = dict(text.get("sparse_attention_config") or {})
    out: dict[str, Any] = {k: sparse[k] for k in SPARSE_KEYS if k in sparse}
    if "num_local_experts" not in text and "num_experts" in text:
        out["num_local_experts"] = text["num_experts"]
    layers = int(text.get("num_hidden_layers", cls.num_hidden_layers))
    for key, src in (("moe_layer_freq", text.get("moe_layer_freq")),
                     ("sparse_attention_freq", sparse.get("sparse_attention_freq"))):
        if src is None:
            continue
        if isinstance(src, int):  # "every k-th layer" form
            out[key] = tuple(int(i % src == src - 1) if src > 0 else 0 for i in range(layers))
        else:
            out[key] = tuple(int(v) for v in src)
    return out


def _transformers_form(text: dict[str, Any], cls) -> dict[str, Any]:
    """Fields of the form transformers' save_pretrained writes, named as the release names them."""
    out: dict[str, Any] = {TRANSFORMERS_INDEX_KEYS[k]: v for k, v in text.items() if k in TRANSFORMERS_INDEX_KEYS}
    for key, field_name, names in (("layer_types", "sparse_attention_freq", ATTENTION_LAYER_TYPES),
                                   ("mlp_layer_types", "moe_layer_freq", MLP_LAYER_TYPES)):
        if text.get(key) is None:
            continue
        unknown = sorted({t for t in text[key] if t not in names})
        if unknown:
            raise ConfigError(f"config field '{key}': expected entries of {sorted(names)}, got {unknown}")
        out[field_name] = tuple(names[t] for t in text[key])
    rope = text.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, dict):
            raise ConfigError(f"config field 'rope_parameters': expected a dict, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"config field 'rope_parameters.rope_type': only 'default' RoPE is supported, "
                              f"got {rope_type!r}")
        if "rope_theta" in rope:
            out["rope_theta"] = float(rope["rope_theta"])
    factor = text.get("partial_rotary_factor", (rope or {}).get("partial_rotary_factor"))
    if factor is not None:
        head_dim = text.get("head_dim", cls.head_dim)
        rotary = head_dim * float(factor)
        if rotary != int(rotary):
            raise ConfigError(f"config field 'partial_rotary_factor': head_dim={head_dim} x {factor} is not a whole "
                              "number of rotary dims")
        out["rotary_dim"] = int(rotary)
    return out


def _tiny(num_layers: int = 3, num_dense: int = 1, **changes) -> MiniMaxM3Config:
    flags = (0,) * num_dense + (1,) * (num_layers - num_dense)
    return MiniMaxM3Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, rotary_dim=16, max_position_embeddings=4096,
        dense_intermediate_size=96, intermediate_size=32, shared_intermediate_size=32,
        num_local_experts=8, num_experts_per_tok=2, moe_layer_freq=flags,
        sparse_attention_freq=flags, sparse_block_size=16, sparse_topk_blocks=4,
        sparse_num_index_heads=2, sparse_index_dim=32).replace(**changes)


PRESETS = {
    "real": MiniMaxM3Config,  # MiniMaxAI/MiniMax-M3's text config
    "tiny": _tiny,  # 3 layers (1 dense, 2 sparse MoE), 16-token blocks, top-4 blocks
    "tiny2": lambda: _tiny(2, 1),  # 1 dense + 1 sparse MoE layer, for graph snapshots
    # 2 dense + 2 sparse MoE layers whose shards stay whole MX blocks at TP 2 and 4 (2 kv heads:
    # split at TP 2, replicated at TP 4)
    "tiny_tp": lambda: _tiny(4, 2, intermediate_size=128, shared_intermediate_size=128, dense_intermediate_size=128),
}


def preset(name: str) -> MiniMaxM3Config:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}") from None
