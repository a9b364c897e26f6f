"""Weight containers of the text model, in the form the ops take them, and random initialisers.

A linear weight is a (weight, scale) pair whose format follows from the dtypes (see formats.py).
Dense layers keep their MLP in ``w13`` [2I, H] / ``w2`` [H, I]; sparse MoE layers keep expert
tables there ([E', 2I, H] / [E', H, I]) with the shared expert either as table entry E (E' = E + 1)
or separate in ``shared_w13`` / ``shared_w2``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .config import DENSE, SPARSE_MOE, MiniMaxM3Config
from .formats import (CANONICAL, FMT_MXFP4, FMT_MXFP4_WORDS, MMA_K, WeightFormat, pack_mxfp4_words, quantize,
                      to_layout, to_mma_layout, weight_layout)

SHARED_SEPARATE = "separate"
SHARED_IN_TABLE = "table"


@dataclass
class LayerWeights:
    kind: str
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_scale: torch.Tensor | None
    o_proj: torch.Tensor
    o_proj_scale: torch.Tensor | None
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    w13: torch.Tensor
    w13_scale: torch.Tensor | None
    w2: torch.Tensor
    w2_scale: torch.Tensor | None
    index_q_norm: torch.Tensor | None = None
    index_k_norm: torch.Tensor | None = None
    gate: torch.Tensor | None = None  # fp32 [E, H]
    gate_bias: torch.Tensor | None = None  # fp32 [E]
    shared_w13: torch.Tensor | None = None
    shared_w13_scale: torch.Tensor | None = None
    shared_w2: torch.Tensor | None = None
    shared_w2_scale: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def map(self, fn) -> "LayerWeights":
        """The same weights with fn applied to every tensor (other fields as they are)."""
        return dataclasses.replace(self, **{k: fn(v) for k, v in self.tensors().items()})

    def to(self, device) -> "LayerWeights":
        return self.map(lambda t: t.to(device))

    @property
    def shared_in_table(self) -> bool:
        return self.kind == SPARSE_MOE and self.shared_w13 is None and self.gate is not None \
            and self.w13.shape[0] == self.gate.shape[0] + 1


@dataclass
class ModelWeights:
    embed: torch.Tensor  # bf16 [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # bf16 [V, H]

    def to(self, device) -> "ModelWeights":
        return ModelWeights(self.embed.to(device), [w.to(device) for w in self.layers],
                            self.final_norm.to(device), self.lm_head.to(device))


def _randn(shape, generator, std) -> torch.Tensor:
    device = generator.device if generator is not None else "cpu"
    return torch.randn(shape, generator=generator, device=device) * std


def _linear(n: int, k: int, fmt, generator, experts: int | None = None):
    if experts is None:
        return quantize(_randn((n, k), generator, k ** -0.5), fmt)
    # One expert at a time: real-size tables are too large to quantise in one piece.
    pairs = [quantize(_randn((n, k), generator, k ** -0.5), fmt) for _ in range(experts)]
    scales = None if pairs[0][1] is None else torch.stack([p[1] for p in pairs])
    return torch.stack([p[0] for p in pairs]), scales


def _tile_code(weight: torch.Tensor, scale: torch.Tensor | None, rank: int) -> int | None:
    """The kernels' decode code of the tiled form of a canonical weight (MXFP4 tiles hold words);
    None when the weight is not canonical (already re-laid)."""
    layout = weight_layout(weight, scale, rank)
    if layout is not CANONICAL[layout.element]:
        return None
    return FMT_MXFP4_WORDS if layout.code == FMT_MXFP4 else layout.code


def _words(weight, scale):
    """MXFP4 as pre-placed words (formats ``mxfp4_words``); other formats unchanged."""
    if weight.dtype == torch.uint8 and scale is not None:
        return pack_mxfp4_words(weight.contiguous()), scale
    return weight, scale


def _mma(weight, scale):
    """An MXFP4 / MXFP8 matrix or expert table in ``mxfp4_mma`` / ``mxfp8_mma`` (the mma.sync
    kernels' layouts) where it fits (to_mma_layout's conditions, and K a multiple of 128, the
    smallest K the mma kernels are tiled and tested for); else as words (MXFP4) or unchanged."""
    layout = weight_layout(weight, scale, weight.dim())
    if layout.name not in ("mxfp4", "mxfp8") or (weight.shape[-1] * layout.k_per_unit) % (2 * MMA_K):
        return _words(weight, scale)
    try:
        return to_mma_layout(weight, scale)
    except ValueError:  # N, scale range or NaN codes: the layout cannot hold this weight
        return _words(weight, scale)


def _tiled(weight, scale, tiles_of, rank):
    code = _tile_code(weight, scale, rank)
    tiles = None if code is None else tiles_of(code)
    if tiles is None:
        return _words(weight, scale)
    return to_layout(weight, scale, tiles, rank)


def mma_layout_default() -> bool:
    """Whether to_kernel_layout lays MX weights out in the mma layouts by default: where their
    inline-PTX kernels run (NVIDIA sm_90+, MINIMAX_OPS_NO_PTX unset; elsewhere they would fall back
    to a slow emulation)."""
    from .kernels.mx_decode import use_ptx
    return torch.cuda.is_available() and use_ptx(torch.device("cuda", torch.cuda.current_device()))


def to_kernel_layout(w: LayerWeights, tiled: bool = False, mma: bool | None = None) -> LayerWeights:
    """The layer's weights re-laid once, at load time, for the kernels (formats.LAYOUTS): MXFP4 as
    pre-placed words, and every MXFP4 / MXFP8 matrix and expert table (qkv, o_proj, routed table,
    shared expert, dense MLP) as ``mxfp4_mma`` / ``mxfp8_mma`` where it fits (``mma``; default:
    where their PTX kernels run, mma_layout_default);
    with ``tiled`` every weight in tiles (tile sizes from kernels/tiles.py) instead: qkv and o_proj
    as GEMV tiles, expert tables, the shared expert and the dense MLP as expert tiles.
    BENCHMARKS.md has the layouts measured. Weights no layout fits, or already re-laid, stay as they
    are. The reference reads every layout (formats.to_canonical)."""
    from .kernels.tiles import expert_layout_tiles, linear_layout_tiles

    def linear(weight, scale):
        if not tiled:
            return _mma(weight, scale) if mma else _words(weight, scale)
        n, k = weight.shape[0], weight.shape[1] * CANONICAL[weight_layout(weight, scale).element].k_per_unit
        return _tiled(weight, scale, lambda code: linear_layout_tiles(code, n, k), 2)

    def mlp(w13, s13, w2, s2, rank):
        if mma and not tiled:
            w13k, s13k, w2k, s2k = (*_mma(w13, s13), *_mma(w2, s2))
            if (w13k.dim() == w13.dim()) == (w2k.dim() == w2.dim()):  # both or neither re-laid
                return w13k, s13k, w2k, s2k
        if not tiled:
            return (*_words(w13, s13), *_words(w2, s2))
        hidden = w2.shape[-2]
        inter = w13.shape[-2] // 2
        code = _tile_code(w13, s13, rank)
        tiles = None if code is None else expert_layout_tiles(code, hidden, inter)
        if tiles is None or _tile_code(w2, s2, rank) != code:
            return w13, s13, w2, s2
        return (*to_layout(w13, s13, tiles[0], rank), *to_layout(w2, s2, tiles[1], rank))

    mma = mma_layout_default() if mma is None else mma
    qkv, qkv_s = linear(w.qkv, w.qkv_scale)
    o, o_s = linear(w.o_proj, w.o_proj_scale)
    w13, s13, w2, s2 = mlp(w.w13, w.w13_scale, w.w2, w.w2_scale, 3 if w.kind == SPARSE_MOE else 2)
    out = dataclasses.replace(w, qkv=qkv, qkv_scale=qkv_s, o_proj=o, o_proj_scale=o_s, w13=w13, w13_scale=s13,
                              w2=w2, w2_scale=s2)
    if w.shared_w13 is not None:
        sw13, ss13, sw2, ss2 = mlp(w.shared_w13, w.shared_w13_scale, w.shared_w2, w.shared_w2_scale, 2)
        out = dataclasses.replace(out, shared_w13=sw13, shared_w13_scale=ss13, shared_w2=sw2, shared_w2_scale=ss2)
    return out


def _device_generator(generator: torch.Generator | None, device) -> torch.Generator | None:
    """Draw on the target device (real-size weights are slow to make on the CPU)."""
    device = torch.device(device)
    if device.type == "cpu" or (generator is not None and generator.device == device):
        return generator
    seed = int(torch.randint(2**62, (1,), generator=generator))
    return torch.Generator(device).manual_seed(seed)


def _norm(size: int, generator) -> torch.Tensor:
    # Gemma norms scale by (1 + w): small random w keeps activations near unit RMS.
    return _randn((size,), generator, 0.1).to(torch.bfloat16)


def random_layer_weights(config: MiniMaxM3Config, layer: int, *, linear_format: str = "bf16",
                         expert_format: str | None = None, shared: str = SHARED_SEPARATE,
                         shared_format: str | None = None, generator: torch.Generator | None = None,
                         device: torch.device | str = "cpu") -> LayerWeights:
    """Random weights with unit-variance outputs. linear_format applies to qkv, o_proj and dense MLPs,
    expert_format (default: linear_format) to routed experts, shared_format (default: expert_format)
    to a separate shared expert."""
    expert_format = WeightFormat(expert_format or linear_format)
    shared_format = WeightFormat(shared_format or expert_format)
    if shared not in (SHARED_SEPARATE, SHARED_IN_TABLE):
        raise ValueError(f"shared: expected {SHARED_SEPARATE!r} or {SHARED_IN_TABLE!r}, got {shared!r}")
    c, g, hid = config, _device_generator(generator, device), config.hidden_size
    kind = c.layer_kind(layer)
    qkv, qkv_s = _linear(c.qkv_size(layer), hid, linear_format, g)
    o, o_s = _linear(hid, c.q_size, linear_format, g)
    fields = dict(kind=kind, input_norm=_norm(hid, g), post_norm=_norm(hid, g), qkv=qkv, qkv_scale=qkv_s,
                  o_proj=o, o_proj_scale=o_s, q_norm=_norm(c.head_dim, g), k_norm=_norm(c.head_dim, g))
    if kind == DENSE:
        inter = c.dense_intermediate_size
        w13, w13_s = _linear(2 * inter, hid, linear_format, g)
        w2, w2_s = _linear(hid, inter, linear_format, g)
        return LayerWeights(**fields, w13=w13, w13_scale=w13_s, w2=w2, w2_scale=w2_s).to(device)
    experts = c.num_local_experts + (1 if shared == SHARED_IN_TABLE and c.n_shared_experts else 0)
    w13, w13_s = _linear(2 * c.intermediate_size, hid, expert_format, g, experts)
    w2, w2_s = _linear(hid, c.intermediate_size, expert_format, g, experts)
    fields.update(index_q_norm=_norm(c.sparse_index_dim, g), index_k_norm=_norm(c.sparse_index_dim, g),
                  gate=_randn((c.num_local_experts, hid), g, hid ** -0.5),
                  gate_bias=_randn((c.num_local_experts,), g, 0.1),
                  w13=w13, w13_scale=w13_s, w2=w2, w2_scale=w2_s)
    if shared == SHARED_SEPARATE and c.n_shared_experts:
        s13, s13_s = _linear(2 * c.shared_intermediate_size, hid, shared_format, g)
        s2, s2_s = _linear(hid, c.shared_intermediate_size, shared_format, g)
        fields.update(shared_w13=s13, shared_w13_scale=s13_s, shared_w2=s2, shared_w2_scale=s2_s)
    return LayerWeights(**fields).to(device)


def random_model_weights(config: MiniMaxM3Config, *, generator: torch.Generator | None = None,
                         device: torch.device | str = "cpu", **formats) -> ModelWeights:
    hid, vocab = config.hidden_size, config.vocab_size
    layers = [random_layer_weights(config, i, generator=generator, device=device, **formats)
              for i in range(config.num_hidden_layers)]
    embed = _randn((vocab, hid), generator, 1.0).to(torch.bfloat16)
    lm_head = _randn((vocab, hid), generator, hid ** -0.5).to(torch.bfloat16)
    return ModelWeights(embed.to(device), layers, _norm(hid, generator).to(device), lm_head.to(device))


def model_to_kernel_layout(weights: ModelWeights, tiled: bool = False, mma: bool | None = None) -> ModelWeights:
    """Every decoder layer's weights through ``to_kernel_layout`` (embedding and head stay as they are)."""
    return ModelWeights(weights.embed, [to_kernel_layout(w, tiled, mma) for w in weights.layers], weights.final_norm,
                        weights.lm_head)
