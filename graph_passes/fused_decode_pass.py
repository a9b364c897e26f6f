"""MiniMaxM3DecodePass: a post-grad FX pass that rewrites each eligible decode layer into
``torch.ops.minimax.fused_decode_layer`` (sparse MoE) or ``fused_dense_decode_layer`` (dense).

Order of decisions, none of them per step at run time:
1. deployment (once per pass instance): Deployment facts -> refuse all, graph untouched;
2. compile range: only ranges ending at or below MAX_TOKENS tokens (is_applicable_for_range);
3. per layer at match time: the chain's structure (decode_layer_patterns.py) and the step guards on
   FakeTensor metadata (guards.py). A refused layer stays unfused.
Each refusal reason is logged once through logging.getLogger("minimax_ops").

Plain torch.compile: ``torch.compile(model, options={"post_grad_custom_post_pass":
graph_passes.minimax_m3_decode_pass})``. vLLM: ``CompilationConfig(inductor_passes=
{"post_grad_custom_post_pass": "graph_passes.minimax_m3_decode_pass"})``.
"""

from __future__ import annotations

import contextlib
import hashlib
import pathlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx import Graph

from minimax_ops.constants import MAX_TOKENS
from minimax_ops.log import log_once, logger

from .decode_layer_patterns import PATTERNS, Refused
from .deployment import Deployment, deployment_refusal
from .fx_utils import op_of
from .guards import step_refusal

try:  # vLLM wants an InductorPass instance; without vLLM, torch's CustomGraphPass is the contract
    from vllm.compilation.passes.inductor_pass import InductorPass as _PassBase
except Exception:  # noqa: BLE001 - vLLM absent or unimportable on this machine
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase

_ROOT = pathlib.Path(__file__).parents[1]


def source_files() -> list[pathlib.Path]:
    """Every source the rewrite depends on, for uuid(): this package, the op vocabulary and what it
    reads (schemas, limits, step contract, configs) and the deployment reader. All of minimax_ops but
    the kernels' bodies, whose changes cannot alter a rewritten graph, plus minimax_vllm."""
    files = sorted((_ROOT / "graph_passes").glob("*.py")) + sorted((_ROOT / "minimax_vllm").glob("*.py"))
    ops = _ROOT / "minimax_ops"
    files += sorted(p for p in ops.rglob("*.py") if "kernels" not in p.relative_to(ops).parts)
    return files


@contextlib.contextmanager
def uncached_compiles() -> Iterator[None]:
    """Compiles inside reach the pass: Inductor's FX graph cache and AOTAutograd's cache reuse a compiled
    artifact on a hit (the pass's uuid is constant for the same sources) and skip post-grad passes."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


# Readers of the serving engine's deployment (minimax_vllm registers vLLM's on import): the pass asks
# them on every compile; a reader returns None when its engine has no current config.
_deployment_readers: list[Callable[[], Deployment | None]] = []


def add_deployment_reader(reader: Callable[[], Deployment | None]) -> None:
    if reader not in _deployment_readers:
        _deployment_readers.append(reader)


class MiniMaxM3DecodePass(_PassBase):
    """See the module docstring. ``deployment=None`` reads it lazily from vLLM's current config when
    running under vLLM, else uses the permissive default Deployment()."""

    def __init__(self, deployment: Deployment | None = None, *, record: bool = False, checked: bool = False):
        self.deployment = deployment
        self.record = record
        self.checked = checked  # fused layers also run the unfused chain and compare (ops/checked.py)
        self.graphs: list[tuple[str, str]] = []  # (before, after) per call when record=True
        self.rewrites = 0  # layers fused, over all calls
        self.calls = 0

    # ---- contract with Inductor / vLLM --------------------------------------------------------
    def uuid(self) -> str:
        h = hashlib.sha256()
        for path in source_files():
            h.update(path.name.encode())  # not the checkout's location: the same sources, the same uuid
            h.update(path.read_bytes())
        h.update(self._deployment().key().encode())
        h.update(f"checked={self.checked}".encode())
        return h.hexdigest()

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        end = getattr(compile_range, "end", compile_range)
        return end is None or end <= MAX_TOKENS

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["graphs"] = []  # recorded graph text is a debugging aid, not configuration
        return state

    def _deployment(self) -> Deployment:
        if self.deployment is not None:
            return self.deployment
        # A reader returns None when its engine has no current config; any other failure propagates.
        for reader in _deployment_readers:
            deployment = reader()
            if deployment is not None:
                return deployment
        if "vllm.config" in sys.modules and not _deployment_readers:
            # vLLM is in use but its deployment cannot be read: refusing is the only safe answer.
            return Deployment(model_config_error="vLLM is loaded but minimax_vllm is not (its plugin reads the "
                                                 "deployment from vLLM's config): import minimax_vllm")
        return Deployment()

    # ---- the rewrite ------------------------------------------------------------------------------
    def __call__(self, graph: Graph) -> None:
        self.calls += 1
        before = str(graph) if self.record else ""
        fused = self.rewrite(graph)
        if self.record:
            self.graphs.append((before, str(graph)))
        logger.debug("minimax_m3_decode_pass fused %d decode layers", fused)

    def rewrite(self, graph: Graph) -> int:
        deployment = self._deployment()
        reason = deployment_refusal(deployment)
        if reason is not None:
            log_once(f"fused decode refused for this deployment: {reason}")
            return 0
        range_ = _current_compile_range()
        if range_ is not None and not self.is_applicable_for_range(range_):
            return 0
        fused = 0
        layer = -1  # decode layers seen so far, in graph order: labels checked-mode reports
        anchors = {p.insert_op: p for p in PATTERNS}
        for node in list(graph.nodes):
            pattern = anchors.get(op_of(node))
            if pattern is None or node.graph is not graph:
                continue
            layer += 1
            try:
                match = pattern.match(node)
                match.kwargs.update(layer_index=layer, checked=self.checked)
                why = step_refusal({**match.kwargs, **match.mutated}, deployment, getattr(range_, "end", None))
                if why is not None:
                    raise Refused(why)
                _check_order(graph, match)
            except Refused as refused:
                log_once(f"decode layer left unfused: {refused}")
                continue
            pattern.replace(graph, match)
            fused += 1
        if fused:
            graph.lint()
        self.rewrites += fused
        return fused


def _check_order(graph: Graph, match) -> None:
    """The fused call goes where the chain's last op was: every outside user of a replaced value
    must come after it, and every input must come before it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    at = order[match.last]
    chain = set(match.nodes)
    for old in match.replaced:
        if old is None:
            continue
        for user in old.users:
            if user not in chain and order[user] < at:
                raise Refused(f"{user.name} reads a layer output before the layer's last op")


def _current_compile_range():
    try:
        from vllm.compilation.passes.inductor_pass import get_pass_context
        return get_pass_context().compile_range
    except Exception:  # noqa: BLE001 - outside vLLM there is no pass context
        return None
