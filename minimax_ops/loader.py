"""HuggingFace-style safetensors checkpoints <-> ModelWeights / MiniMaxM3ForCausalLM.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or shards
``model-0000k-of-0000n.safetensors`` listed in ``model.safetensors.index.json`` (HF's weight_map).
Tensor names follow the MiniMax-M2 family (H = hidden, D = head_dim, E = routed experts):

    model.embed_tokens.weight                    bf16 [V, H]
    model.norm.weight                            [H]
    lm_head.weight                               bf16 [V, H] (optional with tie_word_embeddings)
    model.layers.{i}.input_layernorm.weight      [H]
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.self_attn.{q_proj,k_proj,v_proj,o_proj}.weight          linear
    model.layers.{i}.self_attn.{q_norm,k_norm}.weight                        [D]
  sparse MoE layers:
    model.layers.{i}.self_attn.{index_q_proj,index_k_proj}.weight            linear
    model.layers.{i}.self_attn.{index_q_norm,index_k_norm}.weight            [index_dim]
    model.layers.{i}.block_sparse_moe.gate.weight                            fp32 [E, H]
    model.layers.{i}.block_sparse_moe.e_score_correction_bias                fp32 [E]
    model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight          linear (gate, up, down)
    model.layers.{i}.block_sparse_moe.shared_experts.{gate_proj,up_proj,down_proj}.weight   linear
  dense layers:
    model.layers.{i}.mlp.{gate_proj,up_proj,down_proj}.weight                linear

A "linear" [N, K] is stored as one of: bf16 ``.weight`` [N, K]; MXFP8 float8_e4m3fn ``.weight``
[N, K] + uint8 E8M0 ``.weight_scale_inv`` [N, K/32]; MXFP4 packed uint8 ``.weight`` [N, K/2] +
uint8 E8M0 ``.weight_scale`` [N, K/32]. Norms may be bf16 or fp32; the router gate and bias are
read as fp32 (a bf16 gate is widened exactly).

The loader fuses into the forms the ops take (weights.py): qkv = rows of q, k, v (, index_q,
index_k); w13 = rows of gate then up [2I, H]; experts stacked [E, ...]. With ``shared="table"``
the shared expert becomes table entry E (it must then share the routed experts' format).
Every error names the offending tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import DENSE, SPARSE_MOE, MiniMaxM3Config
from .constants import MX_BLOCK
from .formats import WeightFormat, weight_format
from .sharding import local_config, shard_tensor
from .weights import SHARED_IN_TABLE, SHARED_SEPARATE, LayerWeights, ModelWeights

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FP8_SCALE = "weight_scale_inv"  # MXFP8 (the MiniMax-M2 family's name for the block scale)
FP4_SCALE = "weight_scale"  # MXFP4
NORM_DTYPES = (torch.bfloat16, torch.float32)
ROUTER_DTYPES = (torch.float32, torch.bfloat16)
LINEAR_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.uint8)
ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj")


class CheckpointError(ValueError):
    """A checkpoint tensor is unknown, missing, mis-shaped or of the wrong dtype (named in the message)."""


# ---- the vision-language release: its text model ----------------------------------------------------------

# The official release is the VL model (MiniMaxM3SparseForConditionalGeneration): the text model's tensors
# sit under LANGUAGE_MODEL, beside parts the text decoder does not use, skipped by these rules (and reported).
LANGUAGE_MODEL = "language_model."
SKIPPED_PREFIXES = {"vision_tower.": "vision tower", "multi_modal_projector.": "projector",
                    "patch_merge_mlp.": "projector"}
MTP_SEGMENT = "mtp."  # multi-token-prediction modules (speculative heads), e.g. model.mtp.layers.0...


def _skipped_part(name: str) -> str | None:
    for prefix, part in SKIPPED_PREFIXES.items():
        if name.startswith(prefix):
            return part
    if name.startswith(MTP_SEGMENT) or f".{MTP_SEGMENT}" in name:
        return "MTP"
    return None


def text_model_names(names: Iterable[str]) -> tuple[dict[str, str], dict[str, int]]:
    """(text-model name -> checkpoint name, skipped tensors per part) of a checkpoint's names. A VL
    checkpoint (any name under ``language_model.``) has its text tensors read from under that prefix;
    vision tower, projector and MTP tensors are skipped in either layout. Anything else keeps its
    name, so that an unexpected tensor is still rejected by name."""
    names = list(names)
    vl = any(n.startswith(LANGUAGE_MODEL) for n in names)
    mapping: dict[str, str] = {}
    skipped: dict[str, int] = {}
    for name in names:
        text = name.removeprefix(LANGUAGE_MODEL) if vl else name
        part = _skipped_part(text)
        if part is not None:
            skipped[part] = skipped.get(part, 0) + 1
            continue
        if vl and text == name and not name.startswith(LANGUAGE_MODEL):
            raise CheckpointError(f"unknown tensor name {name!r} (a vision-language checkpoint keeps its text model "
                                  f"under {LANGUAGE_MODEL!r}; only {sorted(SKIPPED_PREFIXES)} and MTP tensors "
                                  "may sit outside it)")
        if text in mapping:
            raise CheckpointError(f"{name}: stored twice, as {mapping[text]!r} too")
        mapping[text] = name
    if skipped:
        from .log import log_once
        log_once("checkpoint: skipped tensors the text decoder does not use: "
                 + ", ".join(f"{n} {part}" for part, n in sorted(skipped.items())))
    return mapping, skipped


KV_SCALES = ("k_scale", "v_scale")  # optional scalars model.layers.{i}.self_attn.{k,v}_scale: fp8 KV scales


def kv_scales(tensors: Mapping[str, torch.Tensor], config: MiniMaxM3Config) -> list[tuple[float, float]]:
    """Per-layer (k_scale, v_scale) of a checkpoint (1.0 where absent); each must be one positive number.
    The cache then holds fp8(k / k_scale), and attention reads fp8 * k_scale (vLLM's convention)."""
    out = []
    for i in range(config.num_hidden_layers):
        pair = []
        for which in KV_SCALES:
            name = f"{_layer_prefix(i)}self_attn.{which}"
            t = tensors.get(name)
            if t is None:
                pair.append(1.0)
                continue
            if t.numel() != 1 or not t.is_floating_point() or not float(t) > 0:
                raise CheckpointError(f"{name}: expected one positive float, got {t.dtype} shape {tuple(t.shape)}")
            pair.append(float(t))
        out.append(tuple(pair))
    return out


def text_model_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's tensors of a (possibly VL) checkpoint, by text-model name."""
    mapping, _ = text_model_names(tensors.keys())
    return {text: tensors[name] for text, name in mapping.items()}


# ---- the expected tensors of a config ------------------------------------------------------------


def _layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def _expected(config: MiniMaxM3Config) -> tuple[dict[str, tuple[tuple[int, ...], tuple]], dict[str, tuple[int, int]]]:
    """(plain tensors: name -> (shape, accepted dtypes), linears: base name -> logical (N, K))."""
    c, hid = config, config.hidden_size
    plain = {"model.embed_tokens.weight": ((c.vocab_size, hid), (torch.bfloat16,)),
             "model.norm.weight": ((hid,), NORM_DTYPES)}
    if not c.tie_word_embeddings:
        plain["lm_head.weight"] = ((c.vocab_size, hid), (torch.bfloat16,))
    linears: dict[str, tuple[int, int]] = {}
    for i in range(c.num_hidden_layers):
        p, attn = _layer_prefix(i), _layer_prefix(i) + "self_attn."
        for name in ("input_layernorm", "post_attention_layernorm"):
            plain[f"{p}{name}.weight"] = ((hid,), NORM_DTYPES)
        for name in ("q_norm", "k_norm"):
            plain[f"{attn}{name}.weight"] = ((c.head_dim,), NORM_DTYPES)
        sizes = _qkv_sizes(c, i)
        for name, rows in zip(ATTN_PROJ, sizes):
            linears[attn + name] = (rows, hid)
        linears[attn + "o_proj"] = (hid, c.q_size)
        if c.layer_kind(i) == DENSE:
            _mlp_linears(linears, p + "mlp.", c.dense_intermediate_size, hid)
            continue
        for name in ("index_q_norm", "index_k_norm"):
            plain[f"{attn}{name}.weight"] = ((c.sparse_index_dim,), NORM_DTYPES)
        moe = p + "block_sparse_moe."
        plain[moe + "gate.weight"] = ((c.num_local_experts, hid), ROUTER_DTYPES)
        if c.use_routing_bias:
            plain[moe + "e_score_correction_bias"] = ((c.num_local_experts,), ROUTER_DTYPES)
        for e in range(c.num_local_experts):
            _mlp_linears(linears, f"{moe}experts.{e}.", c.intermediate_size, hid, ("w1", "w3", "w2"))
        if c.n_shared_experts:
            _mlp_linears(linears, moe + "shared_experts.", c.shared_intermediate_size, hid)
    return plain, linears


def _qkv_sizes(c: MiniMaxM3Config, layer: int) -> list[int]:
    sizes = [c.q_size, c.kv_size, c.kv_size]
    if c.layer_kind(layer) == SPARSE_MOE:
        sizes += [c.index_q_size, c.sparse_index_dim]
    return sizes


def _mlp_linears(linears, prefix, inter, hid, names=("gate_proj", "up_proj", "down_proj")) -> None:
    gate, up, down = names
    linears[prefix + gate] = (inter, hid)
    linears[prefix + up] = (inter, hid)
    linears[prefix + down] = (hid, inter)


def _check_names(names: Iterable[str], config: MiniMaxM3Config) -> None:
    plain, linears = _expected(config)
    required = set(plain) | {b + ".weight" for b in linears}
    optional = {f"{b}.{s}" for b in linears for s in (FP8_SCALE, FP4_SCALE)}
    optional |= {f"{_layer_prefix(i)}self_attn.{s}" for i in range(config.num_hidden_layers) for s in KV_SCALES}
    if config.tie_word_embeddings:
        optional.add("lm_head.weight")
    names = set(names)
    unknown = sorted(names - required - optional)
    if unknown:
        raise CheckpointError(f"unknown tensor name {unknown[0]!r}" + _more(unknown)
                              + " (not part of a MiniMax-M3 text model with this config)")
    missing = sorted(required - names, key=_natural)
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r}" + _more(missing))


def _more(names: list[str]) -> str:
    return f" and {len(names) - 1} more, e.g. {names[1:4]}" if len(names) > 1 else ""


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in name.split(".")]


# ---- reading -------------------------------------------------------------------------------------------


class _Reader:
    """Tensors by name, read one at a time; each is checked against its expected shape and dtype."""

    def __init__(self, get: Callable[[str], torch.Tensor], names: Iterable[str], device):
        self._get, self.names, self.device = get, set(names), torch.device(device)

    def plain(self, name: str, shape: tuple[int, ...], dtypes: tuple) -> torch.Tensor:
        t = self._get(name)
        _check_dtype(name, t, dtypes)
        _check_shape(name, t, shape)
        return t.to(self.device)

    def linear(self, base: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        name = base + ".weight"
        w = self._get(name)
        _check_dtype(name, w, LINEAR_DTYPES)
        scale_suffix = {torch.float8_e4m3fn: FP8_SCALE, torch.uint8: FP4_SCALE}.get(w.dtype)
        for suffix in (FP8_SCALE, FP4_SCALE):
            if suffix != scale_suffix and f"{base}.{suffix}" in self.names:
                takes = f"its scale is '{scale_suffix}'" if scale_suffix else "it takes no scale"
                raise CheckpointError(f"{base}.{suffix}: unexpected tensor ({name} is {w.dtype}: {takes})")
        _check_shape(name, w, (n, k // 2 if w.dtype == torch.uint8 else k))
        if scale_suffix is None:
            return w.to(self.device), None
        scale_name = f"{base}.{scale_suffix}"
        if scale_name not in self.names:
            fmt = "MXFP8" if w.dtype == torch.float8_e4m3fn else "MXFP4"
            raise CheckpointError(f"missing tensor {scale_name!r} ({name} is {w.dtype}, {fmt} needs its E8M0 scale)")
        s = self._get(scale_name)
        _check_dtype(scale_name, s, (torch.uint8,))
        _check_shape(scale_name, s, (n, k // MX_BLOCK))
        return w.to(self.device), s.to(self.device)


def _check_dtype(name: str, t: torch.Tensor, dtypes: tuple) -> None:
    if t.dtype not in dtypes:
        raise CheckpointError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def _same_format(parts: list[tuple[str, torch.Tensor, torch.Tensor | None]]) -> None:
    """Tensors fused into one matrix (or one expert table) must share a format."""
    first, fmt0 = parts[0][0], weight_format(parts[0][1], parts[0][2])
    for name, w, s in parts[1:]:
        fmt = weight_format(w, s)
        if fmt != fmt0:
            raise CheckpointError(f"{name}: format {fmt.value} differs from {first}'s {fmt0.value}; "
                                  "tensors fused into one matrix must share a format")


def _fuse(parts: list[tuple[str, torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate linears along their output rows."""
    _same_format(parts)
    weight = torch.cat([w for _, w, _ in parts], dim=-2)
    scale = None if parts[0][2] is None else torch.cat([s for _, _, s in parts], dim=-2)
    return weight, scale


def _stack(parts: list[tuple[str, torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Experts' matrices into one table [E, N, K']."""
    _same_format(parts)
    weight = torch.stack([w for _, w, _ in parts])
    scale = None if parts[0][2] is None else torch.stack([s for _, _, s in parts])
    return weight, scale


def _read_mlp(rd: _Reader, linears, prefix: str, names=("gate_proj", "up_proj", "down_proj")):
    """(name, w13, s13), (name, w2, s2) of one SwiGLU MLP: w13 = gate rows then up rows."""
    gate, up, down = (prefix + n for n in names)
    w13, s13 = _fuse([(gate + ".weight", *rd.linear(gate, *linears[gate])),
                      (up + ".weight", *rd.linear(up, *linears[up]))])
    w2, s2 = rd.linear(down, *linears[down])
    return (gate + ".weight", w13, s13), (down + ".weight", w2, s2)


def _read_layer(rd: _Reader, config: MiniMaxM3Config, i: int, plain, linears, shared: str) -> LayerWeights:
    c, p = config, _layer_prefix(i)
    attn, kind = p + "self_attn.", c.layer_kind(i)
    get = lambda name: rd.plain(name, *plain[name])  # noqa: E731
    proj = ATTN_PROJ[:len(_qkv_sizes(c, i))]
    qkv, qkv_s = _fuse([(attn + n + ".weight", *rd.linear(attn + n, *linears[attn + n])) for n in proj])
    o, o_s = rd.linear(attn + "o_proj", *linears[attn + "o_proj"])
    fields = dict(kind=kind, input_norm=get(p + "input_layernorm.weight"),
                  post_norm=get(p + "post_attention_layernorm.weight"), qkv=qkv, qkv_scale=qkv_s, o_proj=o,
                  o_proj_scale=o_s, q_norm=get(attn + "q_norm.weight"), k_norm=get(attn + "k_norm.weight"))
    if kind == DENSE:
        (_, w13, s13), (_, w2, s2) = _read_mlp(rd, linears, p + "mlp.")
        return LayerWeights(**fields, w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)
    moe = p + "block_sparse_moe."
    ups, downs = [], []
    for e in range(c.num_local_experts):
        up, down = _read_mlp(rd, linears, f"{moe}experts.{e}.", ("w1", "w3", "w2"))
        ups.append(up)
        downs.append(down)
    fields.update(index_q_norm=get(attn + "index_q_norm.weight"), index_k_norm=get(attn + "index_k_norm.weight"),
                  gate=get(moe + "gate.weight").float(),
                  gate_bias=get(moe + "e_score_correction_bias").float() if c.use_routing_bias else None)
    if c.n_shared_experts:
        s_up, s_down = _read_mlp(rd, linears, moe + "shared_experts.")
        if shared == SHARED_IN_TABLE:
            ups.append(s_up)
            downs.append(s_down)
        else:
            fields.update(shared_w13=s_up[1], shared_w13_scale=s_up[2], shared_w2=s_down[1],
                          shared_w2_scale=s_down[2])
    w13, s13 = _stack(ups)
    w2, s2 = _stack(downs)
    return LayerWeights(**fields, w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)


def weights_from_tensors(tensors: Mapping[str, torch.Tensor] | _Reader, config: MiniMaxM3Config, *,
                         shared: str = SHARED_SEPARATE, device: torch.device | str = "cpu", tp_rank: int = 0,
                         tp_size: int = 1, layers: range | None = None) -> ModelWeights:
    """ModelWeights from checkpoint-named tensors (a state dict, or a reader over safetensors files).
    tp_rank / tp_size: this tensor-parallel rank's shard of a full checkpoint (sharding.py), in the
    shapes of sharding.local_config; layers: only these layers (a pipeline stage), default all."""
    if shared not in (SHARED_SEPARATE, SHARED_IN_TABLE):
        raise ValueError(f"shared: expected {SHARED_SEPARATE!r} or {SHARED_IN_TABLE!r}, got {shared!r}")
    rd = tensors if isinstance(tensors, _Reader) else _Reader(tensors.__getitem__, tensors.keys(), device)
    _check_names(rd.names, config)
    full, config = config, local_config(config, tp_size)
    if tp_size > 1:  # each tensor is sharded as it is read, so a rank never holds another rank's part
        rd = _Reader(lambda name, get=rd._get: shard_tensor(name, get(name), full, tp_rank, tp_size), rd.names,
                     rd.device)
    plain, linears = _expected(config)
    embed = rd.plain("model.embed_tokens.weight", *plain["model.embed_tokens.weight"])
    lm_head = embed
    if "lm_head.weight" in rd.names:
        lm_head = rd.plain("lm_head.weight", (config.vocab_size, config.hidden_size), (torch.bfloat16,))
    layers = [_read_layer(rd, config, i, plain, linears, shared)
              for i in (range(config.num_hidden_layers) if layers is None else layers)]
    return ModelWeights(embed, layers, rd.plain("model.norm.weight", *plain["model.norm.weight"]), lm_head)


def _checkpoint_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no .safetensors files (nor {INDEX_FILE})")
    return files


def load_weights(path_or_dir: str | os.PathLike, config: MiniMaxM3Config | None = None, *,
                 shared: str = SHARED_SEPARATE, device: torch.device | str = "cpu", tp_rank: int = 0,
                 tp_size: int = 1, layers: range | None = None) -> tuple[MiniMaxM3Config, ModelWeights]:
    """Read a checkpoint directory (or one .safetensors file) into the fused ModelWeights (one
    tensor-parallel rank's shard, one pipeline stage's layers: see weights_from_tensors).
    config defaults to the config.json beside the tensors; the whole model's config is returned."""
    path = Path(path_or_dir)
    if config is None:
        config_path = (path.parent if path.is_file() else path) / CONFIG_FILE
        if not config_path.exists():
            raise CheckpointError(f"{config_path}: not found; pass config= or save a config.json beside the tensors")
        config = MiniMaxM3Config.from_hf_dict(json.loads(config_path.read_text()))
    where: dict[str, Path] = {}
    handles = {}
    for f in _checkpoint_files(path):
        handles[f] = safe_open(str(f), framework="pt", device="cpu")
        for name in handles[f].keys():
            if name in where:
                raise CheckpointError(f"{name}: stored twice, in {where[name].name} and {f.name}")
            where[name] = f
    stored, _ = text_model_names(where)  # text-model name -> stored name (VL prefix, skipped parts)
    reader = _Reader(lambda name: handles[where[stored[name]]].get_tensor(stored[name]), stored, device)
    return config, weights_from_tensors(reader, config, shared=shared, device=device, tp_rank=tp_rank,
                                        tp_size=tp_size, layers=layers)


def load_model(path: str | os.PathLike, config: MiniMaxM3Config | None = None, *, shared: str = SHARED_SEPARATE,
               device: torch.device | str = "cpu", tp_group=None, layers: range | None = None):
    """MiniMaxM3ForCausalLM with the checkpoint's weights. tp_group: a torch.distributed ProcessGroup;
    the model then holds this process's shard (its rank in the group) and all-reduces over the group."""
    from .model import MiniMaxM3ForCausalLM

    tp_rank, tp_size = (0, 1) if tp_group is None else (tp_group.rank(), tp_group.size())
    config, weights = load_weights(path, config, shared=shared, device=device, tp_rank=tp_rank, tp_size=tp_size,
                                   layers=layers)
    model = MiniMaxM3ForCausalLM(config, weights, tp_size=tp_size, tp_group=tp_group if tp_size > 1 else None,
                                 layers=layers)
    scale_names = {f"{_layer_prefix(i)}self_attn.{s}" for i in range(config.num_hidden_layers) for s in KV_SCALES}
    scales = kv_scales(_read_named(Path(path), scale_names), config)  # per layer, replicated on every rank
    for layer, (k_scale, v_scale) in zip(model.model.layers, scales[model.layer_range.start:]):
        layer.k_scale, layer.v_scale = k_scale, v_scale
    return model


def _read_named(path: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of ``names`` (text-model names) a checkpoint holds."""
    out = {}
    for f in _checkpoint_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            stored, _ = text_model_names(handle.keys())
            out.update({text: handle.get_tensor(name) for text, name in stored.items() if text in names})
    return out


# ---- writing -------------------------------------------------------------------------------------------


def _own(t: torch.Tensor) -> torch.Tensor:
    # safetensors refuses tensors that share storage (our splits are views of one fused matrix).
    return t.detach().to("cpu").clone(memory_format=torch.contiguous_format)


def _put_linear(out: dict, base: str, w: torch.Tensor, s: torch.Tensor | None) -> None:
    out[base + ".weight"] = _own(w)
    if s is not None:
        suffix = FP8_SCALE if weight_format(w, s) is WeightFormat.MXFP8 else FP4_SCALE
        out[f"{base}.{suffix}"] = _own(s)


def _put_mlp(out, prefix, w13, s13, w2, s2, names=("gate_proj", "up_proj", "down_proj")) -> None:
    gate, up, down = names
    half = w13.shape[-2] // 2
    _put_linear(out, prefix + gate, w13[:half], None if s13 is None else s13[:half])
    _put_linear(out, prefix + up, w13[half:], None if s13 is None else s13[half:])
    _put_linear(out, prefix + down, w2, s2)


def _put_layer(out: dict, config: MiniMaxM3Config, i: int, w: LayerWeights) -> None:
    c, p = config, _layer_prefix(i)
    attn = p + "self_attn."
    if w.kind != c.layer_kind(i):
        raise CheckpointError(f"weights.layers[{i}]: a {w.kind} layer, but the config makes layer {i} "
                              f"{c.layer_kind(i)}")
    out[p + "input_layernorm.weight"] = _own(w.input_norm)
    out[p + "post_attention_layernorm.weight"] = _own(w.post_norm)
    out[attn + "q_norm.weight"] = _own(w.q_norm)
    out[attn + "k_norm.weight"] = _own(w.k_norm)
    sizes = _qkv_sizes(c, i)
    if w.qkv.shape[0] != sum(sizes):
        raise CheckpointError(f"weights.layers[{i}].qkv: expected {sum(sizes)} rows {sizes}, got {tuple(w.qkv.shape)}")
    scales = [None] * len(sizes) if w.qkv_scale is None else w.qkv_scale.split(sizes)
    for name, part, scale in zip(ATTN_PROJ, w.qkv.split(sizes), scales):
        _put_linear(out, attn + name, part, scale)
    _put_linear(out, attn + "o_proj", w.o_proj, w.o_proj_scale)
    if w.kind == DENSE:
        _put_mlp(out, p + "mlp.", w.w13, w.w13_scale, w.w2, w.w2_scale)
        return
    moe = p + "block_sparse_moe."
    out[attn + "index_q_norm.weight"] = _own(w.index_q_norm)
    out[attn + "index_k_norm.weight"] = _own(w.index_k_norm)
    out[moe + "gate.weight"] = _own(w.gate)
    if w.gate_bias is not None:
        out[moe + "e_score_correction_bias"] = _own(w.gate_bias)
    table = w.w13.shape[0]
    if table not in (c.num_local_experts, c.num_local_experts + c.n_shared_experts) or \
            (table > c.num_local_experts and w.shared_w13 is not None):
        raise CheckpointError(f"weights.layers[{i}].w13: expected {c.num_local_experts} experts (+ the shared one "
                              f"when it is not separate), got {table} with shared_w13 "
                              f"{'given' if w.shared_w13 is not None else 'None'}")
    at = lambda t, e: None if t is None else t[e]  # noqa: E731
    for e in range(table):
        prefix = f"{moe}experts.{e}." if e < c.num_local_experts else moe + "shared_experts."
        names = ("w1", "w3", "w2") if e < c.num_local_experts else ("gate_proj", "up_proj", "down_proj")
        _put_mlp(out, prefix, w.w13[e], at(w.w13_scale, e), w.w2[e], at(w.w2_scale, e), names)
    if w.shared_w13 is not None:
        _put_mlp(out, moe + "shared_experts.", w.shared_w13, w.shared_w13_scale, w.shared_w2, w.shared_w2_scale)


def checkpoint_tensors(weights: ModelWeights, config: MiniMaxM3Config) -> dict[str, torch.Tensor]:
    """The checkpoint-named CPU tensors of ModelWeights (the inverse of weights_from_tensors)."""
    if len(weights.layers) != config.num_hidden_layers:
        raise CheckpointError(f"weights.layers: expected {config.num_hidden_layers} layers, got {len(weights.layers)}")
    out = {"model.embed_tokens.weight": _own(weights.embed), "model.norm.weight": _own(weights.final_norm)}
    if not (config.tie_word_embeddings and torch.equal(weights.lm_head, weights.embed)):
        out["lm_head.weight"] = _own(weights.lm_head)
    for i, layer in enumerate(weights.layers):
        _put_layer(out, config, i, layer)
    # The written checkpoint must load: check names, shapes and dtypes now rather than at load time.
    _check_names(out, config)
    return out


def save_checkpoint(weights: ModelWeights, config: MiniMaxM3Config, path_or_dir: str | os.PathLike, *,
                    max_shard_bytes: int | None = None) -> list[Path]:
    """Write config.json and the tensors: one model.safetensors, or shards of at most max_shard_bytes
    (a tensor larger than that gets a shard of its own) with model.safetensors.index.json. A path
    ending in .safetensors names the single file (config.json goes beside it). Returns the files."""
    tensors = checkpoint_tensors(weights, config)
    weights_from_tensors(tensors, config)  # shapes and dtypes, with the loader's own checks
    path = Path(path_or_dir)
    single = path.suffix == ".safetensors"
    folder = path.parent if single else path
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(config.to_hf_dict(), indent=2))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if not single and max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        target = path if single else folder / SINGLE_FILE
        save_file(shards[0], str(target), metadata={"format": "pt"})
        return [target]
    files, weight_map = [], {}
    for k, shard in enumerate(shards, 1):
        f = folder / f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(f), metadata={"format": "pt"})
        files.append(f)
        weight_map.update({name: f.name for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2))
    return files
