"""Test helpers for the graph pass: stable text of FX graphs (normalize_graph, op_counts), and a
small harness that compiles the tiny model with the pass and checks a step against the reference.

``normalize_graph(text)`` takes ``str(graph)`` (what ``MiniMaxM3DecodePass(record=True)`` keeps in
``.graphs``) and returns one line per call, stable across runs and processes:

    add_rmsnorm = minimax.add_rmsnorm(embedding, full, in7, 1e-06)
    mx_linear = minimax.mx_linear(add_rmsnorm[0], in8, None)
    qk_norm_rope_kv_insert = af_v2 minimax.qk_norm_rope_kv_insert(qkv=mx_linear, ..., kv_cache=in11!)

- placeholders become ``in<k>`` by their order in the graph (the same in the graph before and after
  the pass), other nodes are named after the op they call with suffixes numbered by appearance;
- getitems are inlined as ``node[i]``; auto_functionalized (v1) and auto_functionalized_v2 calls
  print their op's arguments in schema order with each mutated argument as ``name=base!`` (v2's
  ``_all_bases`` / ``_<name>_base_index`` resolved), so the two forms differ only in the tag;
- symbols (s0, u3, ...) are renumbered by appearance, devices print as ``<device>``; comment lines
  (``# File: ...``) are dropped and paths with line numbers in messages print as ``<path>``.
"""

from __future__ import annotations

import copy
import functools
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch._inductor.custom_graph_pass

import minimax_ops  # noqa: F401  (registers torch.ops.minimax.*, whose schemas order the arguments)
from graph_passes import uncached_compiles
from minimax_ops.cache import StepMetadata, allocate_caches, build_step
from minimax_ops.config import MiniMaxM3Config, preset
from minimax_ops.ops import fused as fused_ops
from minimax_ops.reference_model import model_forward
from minimax_ops.weights import ModelWeights, random_model_weights

AF_TARGETS = {"torch.ops.higher_order.auto_functionalized": "v1",
              "torch.ops.higher_order.auto_functionalized_v2": "v2"}
_NODE = re.compile(r"^%(?P<name>\w+) : .*? = (?P<kind>\w+)\[target=(?P<target>[^\]]+)\]"
                   r"(?:\(args = (?P<args>.*), kwargs = (?P<kwargs>\{.*\})\))?$")
_REF = re.compile(r"%(\w+)")
_SYMBOL = re.compile(r"\b([su])\d+\b")
_PATH = re.compile(r"(?:[\w.-]*/)+[\w.-]+\.py(?::\d+)?|\bline \d+")
_CLOSE = {"(": ")", "[": "]", "{": "}"}


# ---- parsing str(graph) ---------------------------------------------------------------------------------


@dataclass
class Ref:
    name: str


@dataclass
class Seq:
    open: str
    items: list[Any]


@dataclass
class Mapping:
    pairs: list[tuple[str, Any]]


@dataclass
class ParsedNode:
    name: str
    kind: str  # placeholder, call_function, get_attr, output, ...
    target: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    op: str = ""  # display name: "minimax.add_rmsnorm", "aten.sym_size.int"; the wrapped op for af calls
    form: str | None = None  # "v1" / "v2" for auto_functionalized calls
    is_op: bool = False  # calls a torch.ops overload (directly or through auto_functionalized)


class _Reader:
    """Recursive descent over the argument text FX prints: %refs, (), [], {k: v}, quoted strings,
    and atoms (anything else up to the next top-level ',' or closing bracket)."""

    def __init__(self, text: str):
        self.s, self.i = text, 0

    def _skip(self) -> None:
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1

    def value(self) -> Any:
        self._skip()
        c = self.s[self.i]
        if c == "%":
            m = _REF.match(self.s, self.i)
            self.i = m.end()
            return Ref(m.group(1))
        if c in "([":
            return Seq(c, self._items(_CLOSE[c], self.value))
        if c == "{":
            return Mapping(self._items("}", self._pair))
        return self._atom()

    def _pair(self) -> tuple[str, Any]:
        self._skip()
        key_end = self.s.index(":", self.i)
        key = self.s[self.i:key_end].strip()
        self.i = key_end + 1
        return key, self.value()

    def _items(self, close: str, item: Callable[[], Any]) -> list[Any]:
        self.i += 1
        out = []
        while True:
            self._skip()
            if self.s[self.i] == close:
                self.i += 1
                return out
            out.append(item())
            self._skip()
            if self.s[self.i] == ",":
                self.i += 1

    def _atom(self) -> str:
        start, depth, quote = self.i, 0, None
        while self.i < len(self.s):
            c = self.s[self.i]
            if quote:
                if c == "\\":
                    self.i += 1
                elif c == quote:
                    quote = None
            elif c in "'\"":
                quote = c
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                if depth == 0:
                    break
                depth -= 1
            elif c == "," and depth == 0:
                break
            self.i += 1
        return self.s[start:self.i].strip()


def _resolve_op(path: str) -> Any:
    """'minimax.mx_linear.default' (or with 'torch.ops.') -> the OpOverload, or None."""
    obj: Any = torch.ops
    try:
        for part in path.removeprefix("torch.ops.").split("."):
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        return None
    return obj


def _display_op(path: str) -> str:
    """'torch.ops.aten.full.default' -> 'aten.full'; non-default overloads stay ('aten.sym_size.int')."""
    parts = path.removeprefix("torch.ops.").split(".")
    return ".".join(parts[:-1]) if parts[-1] == "default" else ".".join(parts)


def parse_graph(text: str) -> list[ParsedNode]:
    """The nodes of ``str(graph)``, in order; the last one is the output (kind "output")."""
    nodes = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("return "):
            value = _Reader(re.sub(r"(?<![\w%.])([A-Za-z_]\w*)(?=[,)\]]|$)", r"%\1", line[7:])).value()
            nodes.append(ParsedNode("output", "output", "output", [value]))
            continue
        m = _NODE.match(line)
        if m is None:  # graph():, comments (# File: ...), blank lines
            continue
        node = ParsedNode(m["name"], m["kind"], m["target"])
        if m["args"] is not None:
            node.args = _Reader(m["args"]).value().items
            node.kwargs = dict(_Reader(m["kwargs"]).value().pairs)
        if node.kind == "call_function":
            node.form = AF_TARGETS.get(node.target)
            if node.form:
                node.op, node.is_op = _display_op(node.args[0]), True
            elif node.target.startswith("torch.ops."):
                node.op, node.is_op = _display_op(node.target), True
            else:  # operator.getitem, torch.sym_sum, ...
                node.op = node.target
        nodes.append(node)
    return nodes


def op_counts(text: str) -> Counter:
    """How often each op is called (auto_functionalized calls count as their op), getitems aside."""
    return Counter(n.op for n in parse_graph(text) if n.kind == "call_function" and n.op != "operator.getitem")


def functional_forms(text: str) -> Counter:
    """(op, "v1"/"v2") of every auto_functionalized call."""
    return Counter((n.op, n.form) for n in parse_graph(text) if n.form)


# ---- rendering -----------------------------------------------------------------------------------------


class _Renderer:
    def __init__(self, nodes: list[ParsedNode]):
        self.names: dict[str, str] = {}
        self.symbols: dict[str, str] = {}
        self._raw_names: re.Pattern | None = None
        seen: Counter = Counter()
        placeholders = 0
        for n in nodes:
            if n.kind == "placeholder":
                self.names[n.name] = f"in{placeholders}"
                placeholders += 1
            elif n.kind == "call_function" and n.op == "operator.getitem" and isinstance(n.args[0], Ref):
                self.names[n.name] = f"{self.ref(n.args[0])}[{self.value(n.args[1])}]"
            elif n.kind != "output":
                base = n.op.split(".")[1] if n.is_op else re.sub(r"_\d+$", "", n.name)
                self.names[n.name] = base if not seen[base] else f"{base}_{seen[base]}"
                seen[base] += 1
        raw = sorted(self.names, key=len, reverse=True)
        self._raw_names = re.compile(r"\b(?:" + "|".join(map(re.escape, raw)) + r")\b") if raw else None

    def ref(self, r: Ref) -> str:
        return self.names.get(r.name, r.name)

    def value(self, v: Any, key: str | None = None) -> str:
        if isinstance(v, Ref):
            return self.ref(v)
        if isinstance(v, Seq):
            inner = ", ".join(self.value(x) for x in v.items)
            if v.open == "(":
                return f"({inner},)" if len(v.items) == 1 else f"({inner})"
            return f"[{inner}]"
        if isinstance(v, Mapping):
            return "{" + ", ".join(f"{k}: {self.value(x)}" for k, x in v.pairs) + "}"
        if key == "device":
            return "<device>"
        text = _PATH.sub("<path>", v)
        if self._raw_names is not None:  # node names quoted in messages (assertions)
            text = self._raw_names.sub(lambda m: self.names[m.group(0)], text)
        return _SYMBOL.sub(self._symbol, text)

    def _symbol(self, m: re.Match) -> str:
        kind = m.group(1)
        if m.group(0) not in self.symbols:
            self.symbols[m.group(0)] = f"{kind}{sum(s.startswith(kind) for s in self.symbols.values())}"
        return self.symbols[m.group(0)]

    def call(self, n: ParsedNode) -> str:
        if n.form:
            return f"af_{n.form} {n.op}({', '.join(self._functional_args(n))})"
        parts = [self.value(a) for a in n.args] + [f"{k}={self.value(v, k)}" for k, v in n.kwargs.items()]
        return f"{n.op}({', '.join(parts)})"

    def _functional_args(self, n: ParsedNode) -> list[str]:
        kw = dict(n.kwargs)
        op = _resolve_op(n.args[0])
        schema = [a for a in op._schema.arguments] if op is not None else []
        mutable = {a.name for a in schema if a.alias_info is not None and a.alias_info.is_write}
        bases = kw.pop("_all_bases", Seq("[", []))
        out = []
        for a in schema:
            index = kw.pop(f"_{a.name}_base_index", None)
            if index is not None:
                out.append(f"{a.name}={self.value(bases.items[int(index)])}!")
            elif a.name in kw:
                mark = "!" if a.name in mutable else ""
                out.append(f"{a.name}={self.value(kw.pop(a.name), a.name)}{mark}")
        return out + [f"{k}={self.value(v, k)}" for k, v in kw.items()]  # view metadata, unknown extras


def normalize_graph(text: str, *, keep: Callable[[str], bool] | None = None, width: int = 110) -> str:
    """Stable text of ``str(graph)`` (see the module docstring); ``keep(op)`` filters call lines by
    op display name; lines longer than ``width`` wrap at argument boundaries."""
    nodes = parse_graph(text)
    r = _Renderer(nodes)
    lines = []
    for n in nodes:
        if n.kind == "output":
            lines.append(f"return {r.value(n.args[0])}")
        elif n.kind == "call_function" and n.op != "operator.getitem" and (keep is None or keep(n.op)):
            lines.append(f"{r.names[n.name]} = {r.call(n)}")
        elif n.kind not in ("placeholder", "call_function"):
            lines.append(f"{r.names[n.name]} = {n.kind}({r.value(n.target)})")
    return "\n".join(w for line in lines for w in _wrap(line, width)) + "\n"


def _wrap(line: str, width: int) -> list[str]:
    """Break after ', ' outside quoted strings, greedily; continuation lines indented by 4."""
    pieces, start, quote = [], 0, None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote and line[i - 1] != "\\" else quote
        elif c in "'\"":
            quote = c
        elif line.startswith(", ", i):
            pieces.append(line[start:i + 1])
            start = i + 2
    pieces.append(line[start:])
    out = [pieces[0]]
    for piece in pieces[1:]:
        if len(out[-1]) + 1 + len(piece) <= width:
            out[-1] += " " + piece
        else:
            out.append("    " + piece)
    return out


# ---- compile-and-compare harness ---------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def tiny2_weights(seed: int = 0) -> tuple[MiniMaxM3Config, ModelWeights]:
    """preset("tiny2") (1 dense + 1 sparse MoE layer) and random bf16 weights, made once per seed."""
    config = preset("tiny2")
    return config, random_model_weights(config, generator=torch.Generator().manual_seed(seed))


def step_inputs(config: MiniMaxM3Config, context_lens: list[int], query_lens: int | list[int], *, seed: int,
                num_blocks: int = 64, kv_dtype: torch.dtype = torch.bfloat16):
    """(input_ids, StepMetadata, random caches) for one step on shuffled physical blocks."""
    g = torch.Generator().manual_seed(seed)
    caches = allocate_caches(config, num_blocks, kv_dtype=kv_dtype, generator=g)
    meta = build_step(context_lens, query_lens, block_size=config.sparse_block_size, num_blocks=num_blocks,
                      generator=g)
    ids = torch.randint(0, config.vocab_size, (meta.num_tokens,), generator=g)
    return ids, meta, caches


@dataclass
class StepResult:
    out: torch.Tensor
    ref: torch.Tensor
    caches_match: bool  # byte-equal to the reference's caches after the step
    fused_runs: dict[str, int]  # how often each fused op's implementation ran during the step


def run_against_reference(fn: Callable, config: MiniMaxM3Config, weights: ModelWeights, ids: torch.Tensor,
                          meta: StepMetadata, caches: list, positions: torch.Tensor | None = None) -> StepResult:
    """fn(ids, positions, caches, meta) (compiles happen here, uncached) and the reference on clones
    of the caches; positions default to meta.positions (the reference always reads those)."""
    ref_caches = [c.clone() for c in caches]
    before = dict(fused_ops.impl_calls)
    with uncached_compiles():
        out = fn(ids, meta.positions if positions is None else positions, caches, meta)
    runs = {k: fused_ops.impl_calls[k] - before[k] for k in before}
    ref = model_forward(ids, weights, ref_caches, meta, config)
    return StepResult(out, ref, caches_equal(caches, ref_caches), runs)


class GraphKeeper(torch._inductor.custom_graph_pass.CustomGraphPass):
    """A post-grad pass that keeps a copy of each graph (in ``graphs``) and changes nothing."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph) -> None:
        self.graphs.append(copy.deepcopy(graph))

    def uuid(self) -> str:
        return "graph-keeper"


def compile_model(model: torch.nn.Module, graph_pass: Any, *, dynamic: bool | None = False) -> Callable:
    """torch.compile with the pass as post_grad_custom_post_pass (fullgraph; static shapes unless told
    otherwise). Resets Dynamo first: every test model shares the forward code object."""
    torch._dynamo.reset()
    return torch.compile(model, fullgraph=True, dynamic=dynamic, options={"post_grad_custom_post_pass": graph_pass})


def caches_equal(a: list, b: list) -> bool:
    """Byte equality of every layer's kv and index cache."""
    def same(x, y):
        return (x is None) == (y is None) and (x is None or torch.equal(x.view(torch.uint8), y.view(torch.uint8)))
    return all(same(x.kv, y.kv) and same(x.index, y.index) for x, y in zip(a, b, strict=True))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())
