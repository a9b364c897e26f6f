"""The fused decode through vLLM's real VLLM_COMPILE pipeline, on CPU.

MiniMaxM3VllmModel (preset "tiny2": 1 dense + 1 sparse MoE layer) is compiled once per module by vLLM's
@support_torch_compile -> VllmBackend -> PiecewiseBackend -> PostGradPassManager, with the decode pass as
post_grad_custom_post_pass, compile ranges [1, 16] and [17, 64] and no splitting ops. The steps then run
the way vLLM's model runner calls a model: inside a forward context, the step's StepMetadata current
(minimax_ops.step_context). Every step is checked against reference_model.model_forward (logits and
cache bytes). The engine itself (scheduler, KV-cache allocation, vllm.LLM) is tested in test_vllm_engine.py.

Set-up that keeps the pass visible: temporary VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR,
VLLM_DISABLE_COMPILE_CACHE=1 and fx_graph_cache off (a cached artifact skips the pass), VLLM_COMPILE kept
on vLLM's CPU platform (which would turn it into its trace-once mode: vllm_support.forced_vllm_compile),
compile_sizes=[] (None fails on CPU). VLLM_TARGET_DEVICE=cpu may be set or not.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import sys
from dataclasses import dataclass, field
import pathlib
import tomllib
from importlib.metadata import EntryPoint, entry_points

import pytest
from conftest import minimax_reasons
from vllm_support import NO_VLLM_FUSIONS, forced_vllm_compile, isolate_compile_caches, require_vllm
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

import graph_text as gt
import graph_passes
from graph_passes import Deployment, MiniMaxM3DecodePass, deployment_refusal
from graph_passes.guards import step_refusal
from minimax_ops.cache import allocate_caches, build_step, request_block_ids
from minimax_ops.config import preset
from minimax_ops.constants import MAX_CONTEXT, MAX_TOKENS
from minimax_ops.ops import fused as fused_ops
from minimax_ops.reference_model import model_forward
from minimax_ops.weights import random_model_weights

try:
    import vllm  # noqa: F401
    VLLM_IMPORT_ERROR = None
except ImportError as e:  # vLLM not installed: every test below but the CI check skips
    VLLM_IMPORT_ERROR = e

if VLLM_IMPORT_ERROR is None:  # our own modules are imported unguarded: a bug in them must fail, not skip
    from vllm.compilation.passes.inductor_pass import InductorPass, get_pass_context
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import (AttentionConfig, CacheConfig, CompilationConfig, CompilationMode, CUDAGraphMode,
                             DeviceConfig, ModelConfig, ParallelConfig, PassConfig, SchedulerConfig, VllmConfig,
                             set_current_vllm_config)

    import minimax_vllm.deployment as vllm_config_module
    from minimax_vllm.deployment import deployment_from_vllm_config, minimax_m3_config_from_vllm
    from minimax_vllm.plugin import C_OPS_LOOKED_UP, register
    from minimax_vllm.compiled import MiniMaxM3VllmModel, run_step

CFG = preset("tiny2")
BS = CFG.sparse_block_size  # 16
NUM_BLOCKS, MAX_LEN, MAX_SEQS, MAX_BATCHED = 64, 64, 32, 64
FUSED = ("minimax.fused_dense_decode_layer", "minimax.fused_decode_layer")
DECODE_ONLY = ("minimax.dense_attention_decode", "minimax.sparse_attention_decode", "minimax.index_topk")
TOLERANCE = 1e-2  # bf16 activations


@pytest.fixture(scope="module")
def vllm():
    """vLLM itself (skips where it is not installed; in CI a missing vLLM fails)."""
    return require_vllm()


def test_ci_runs_these_tests():
    """CI installs vLLM (.ci/install-vllm): there the tests of this file must run, not skip."""
    if os.environ.get("CI", "").lower() != "true":
        pytest.skip("outside CI, vLLM is optional")
    assert VLLM_IMPORT_ERROR is None, f"CI=true but vLLM does not import: {VLLM_IMPORT_ERROR!r}"


@pytest.fixture(scope="module")
def isolated_caches(vllm, tmp_path_factory):
    """Fresh compile caches for this module (a cached artifact would skip the pass), restored after."""
    root = tmp_path_factory.mktemp("vllm_pipeline")
    with pytest.MonkeyPatch.context() as mp, forced_vllm_compile(mp):
        isolate_compile_caches(mp, root)
        yield root


@pytest.fixture(autouse=True)
def fresh_log(minimax_log):
    return minimax_log


_reasons = minimax_reasons


# ---- building VllmConfigs ------------------------------------------------------------------------------

def vllm_config(graph_pass=None, **parts) -> VllmConfig:
    """A CPU VllmConfig: VLLM_COMPILE, ranges [1, 16] and [17, 64], no splitting ops, no CUDA graphs."""
    inductor = {"fx_graph_cache": False, "combo_kernels": False, "benchmark_combo_kernel": False}
    if graph_pass is not None:
        inductor["post_grad_custom_post_pass"] = graph_pass
    parts.setdefault("compilation_config", CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, backend="inductor", splitting_ops=[], cudagraph_mode=CUDAGraphMode.NONE,
        compile_sizes=[], compile_ranges_endpoints=[MAX_TOKENS], inductor_compile_config=inductor,
        pass_config=PassConfig(**NO_VLLM_FUSIONS)))
    parts.setdefault("device_config", DeviceConfig(device="cpu"))
    parts.setdefault("cache_config", CacheConfig(block_size=BS))  # the platform's default is 128
    parts.setdefault("scheduler_config", SchedulerConfig.default_factory(
        max_num_batched_tokens=MAX_BATCHED, max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS))
    return VllmConfig(**parts)


class _RegistryStub(torch.nn.Module):
    """Test-only model class for an architecture name, so that ModelConfig accepts a MiniMax-M3
    config.json on CPU (vLLM's own MiniMax-M3 class needs its GPU dependencies to be inspected)."""

    def __init__(self, *, vllm_config=None, prefix=""):
        super().__init__()

    def forward(self, input_ids, positions):
        raise NotImplementedError

    def embed_input_ids(self, input_ids):
        raise NotImplementedError

    def compute_logits(self, hidden_states):
        raise NotImplementedError


def minimax_model_config(tmp_path, config=CFG, **model_kwargs) -> ModelConfig:
    """A real ModelConfig whose hf_config is vLLM's MiniMax-M3 config (model_type minimax_m3_vl, the text
    model under text_config), read from a config.json in tmp_path."""
    from vllm import ModelRegistry

    ModelRegistry.register_model("MiniMaxM3OpsTestStub", _RegistryStub)
    text = {**config.to_hf_dict(), "model_type": "minimax_m3_text"}
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3OpsTestStub"], "text_config": text,
         "torch_dtype": "bfloat16"}))
    return ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", **model_kwargs)


# ---- (a) registration by dotted name -------------------------------------------------------------------


def test_dotted_name_resolves_to_the_package_instance(vllm):
    cc = CompilationConfig(inductor_passes={"post_grad_custom_post_pass": "graph_passes.minimax_m3_decode_pass"})
    assert cc.inductor_compile_config["post_grad_custom_post_pass"] is graph_passes.minimax_m3_decode_pass
    assert isinstance(graph_passes.minimax_m3_decode_pass, InductorPass)


def test_plugin_entry_point_registers_the_ops_idempotently(vllm):
    # The entry point as pyproject.toml declares it (the one an install gives vLLM), and the installed
    # one where the package is installed.
    declared = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    value = declared["project"]["entry-points"]["vllm.general_plugins"]["minimax_ops"]
    assert value == "minimax_vllm.plugin:register"
    for installed in entry_points(group="vllm.general_plugins"):
        if installed.name == "minimax_ops":
            assert installed.value == value
    hook = EntryPoint("minimax_ops", value, "vllm.general_plugins").load()
    hook()
    hook()  # vLLM calls it in every process, possibly more than once
    assert hasattr(torch.ops.minimax, "fused_decode_layer")
    from vllm.platforms import current_platform
    if not current_platform.is_cuda_alike():
        assert all(hasattr(torch.ops._C, name) for name in C_OPS_LOOKED_UP)


# ---- one model compiled by vLLM, shared by the pipeline tests -------------------------------------------


class RecordingDecodePass(MiniMaxM3DecodePass):
    """The decode pass, recording what vLLM asked it (is_applicable_for_range), the compile range of
    each call (get_pass_context() asserts outside vLLM's pass manager) and who called it."""

    def __init__(self):
        super().__init__(record=True)
        self.queried: list[tuple[tuple[int, int], bool]] = []
        self.ranges: list[tuple[int, int]] = []
        self.callers: list[str | None] = []

    def is_applicable_for_range(self, compile_range) -> bool:
        applicable = super().is_applicable_for_range(compile_range)
        self.queried.append(((compile_range.start, compile_range.end), applicable))
        return applicable

    def __call__(self, graph: fx.Graph) -> None:
        r = get_pass_context().compile_range
        self.ranges.append((r.start, r.end))
        self.callers.append(_calling_pass_manager())
        super().__call__(graph)


def _calling_pass_manager() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), PostGradPassManager):
            return type(frame.f_locals["self"]).__name__
        frame = frame.f_back
    return None


@dataclass
class Compiled:
    model: MiniMaxM3VllmModel
    graph_pass: RecordingDecodePass
    config: VllmConfig
    weights: object
    first: StepCheck | None = None
    blocks: list = field(default_factory=list)  # physical blocks of the first step's requests
    contexts: list = field(default_factory=list)


@dataclass
class StepCheck:
    error: float
    caches_match: bool
    fused_runs: dict[str, int]


def run_checked(c: Compiled, input_ids, meta) -> StepCheck:
    """One step through the vLLM-compiled model and the reference (on copies of the same caches)."""
    ref_caches = [cache.clone() for cache in c.model.layer_caches()]
    before = dict(fused_ops.impl_calls)
    out = run_step(c.model, input_ids, meta)
    runs = {k: fused_ops.impl_calls[k] - before[k] for k in before}
    ref = model_forward(input_ids, c.weights, ref_caches, meta, CFG)
    assert out.shape == (meta.num_tokens, CFG.vocab_size) and torch.isfinite(out).all()
    real = meta.slot_mapping >= 0  # padding rows carry no meaning
    return StepCheck(gt.relative_error(out[real], ref[real]), gt.caches_equal(c.model.layer_caches(), ref_caches),
                     runs)


def _step(c: Compiled, gen, context_lens, query_lens, **kw):
    meta = build_step(context_lens, query_lens, block_size=BS, num_blocks=NUM_BLOCKS, generator=gen,
                      table_width=c.model.table_width, **kw)
    return torch.randint(0, CFG.vocab_size, (meta.num_tokens,), generator=gen), meta


@pytest.fixture(scope="module")
def compiled(isolated_caches) -> Compiled:
    register()  # what the vllm.general_plugins entry point does in each vLLM process
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    weights = random_model_weights(CFG, generator=gen)
    graph_pass = RecordingDecodePass()
    config = vllm_config(graph_pass)
    with set_current_vllm_config(config):  # vLLM's decorator reads it at construction
        model = MiniMaxM3VllmModel(vllm_config=config, config=CFG, weights=weights, num_blocks=NUM_BLOCKS)
    for cache, fresh in zip(model.layer_caches(), allocate_caches(CFG, NUM_BLOCKS, generator=gen)):
        cache.kv.copy_(fresh.kv)
        if cache.index is not None:
            cache.index.copy_(fresh.index)
    c = Compiled(model, graph_pass, config, weights)
    # First call: Dynamo traces once, every compile range is compiled up front (the pass runs here).
    # 3 requests + 1 padding request, q = 1.
    c.contexts = [37, 20, 5]
    ids, meta = _step(c, gen, c.contexts, 1, pad_requests=1)
    c.first = run_checked(c, ids, meta)
    c.blocks = request_block_ids(meta, BS)
    c.contexts = [n + 1 for n in c.contexts]
    return c


# ---- (b) the pass inside vLLM's PostGradPassManager -----------------------------------------------------


def test_pass_ran_inside_vllms_post_grad_pass_manager_for_the_decode_range_only(compiled):
    p = compiled.graph_pass
    assert compiled.config.compilation_config.mode == CompilationMode.VLLM_COMPILE
    assert compiled.config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"] is p
    assert dict(p.queried) == {(1, MAX_TOKENS): True, (MAX_TOKENS + 1, MAX_BATCHED): False}
    assert p.ranges == [(1, MAX_TOKENS)] and p.calls == 1
    assert p.callers == ["PostGradPassManager"]


def test_decode_range_graph_was_rewritten(compiled):
    ((before, after),) = compiled.graph_pass.graphs
    ops_before, ops_after = gt.op_counts(before), gt.op_counts(after)
    assert not set(FUSED) & set(ops_before)
    assert all(ops_before[op] == 1 for op in DECODE_ONLY)  # vLLM mode: the decode chain was traced
    assert ops_after[FUSED[0]] == 1 and ops_after[FUSED[1]] == 1
    assert not set(DECODE_ONLY) & set(ops_after)
    assert compiled.graph_pass.rewrites == CFG.num_hidden_layers
    # vLLM forces auto_functionalized v1; the fused calls keep that form.
    assert set(gt.functional_forms(after)) == {(FUSED[0], "v1"), (FUSED[1], "v1")}


# ---- (c) decode steps through the vLLM-compiled model ---------------------------------------------------


def test_first_decode_step_matches_the_reference(compiled):
    first = compiled.first
    assert first.fused_runs == {"dense": 1, "sparse": 1}  # the [1, 16] artifact, fused
    assert first.error < TOLERANCE and first.caches_match


def test_next_decode_steps_match_the_reference(compiled):
    gen = torch.Generator().manual_seed(1)
    # The same 3 requests one token later (their blocks), then 7 requests + 2 padding requests.
    steps = [_step(compiled, gen, compiled.contexts, 1, pad_requests=1, block_ids=compiled.blocks),
             _step(compiled, gen, [3, 9, 17, 30, 41, 50, 12], 1, pad_requests=2)]
    for ids, meta in steps:
        check = run_checked(compiled, ids, meta)
        assert check.fused_runs == {"dense": 1, "sparse": 1}
        assert check.error < TOLERANCE and check.caches_match


# ---- (d) batch kinds vLLM cannot guard: same artifact, the ops decide at run time ------------------------


@pytest.mark.parametrize("context_lens,query_lens", [([0], [4]), ([0, 21, 40], [3, 1, 1]), ([0, 33], [6, 2])],
                         ids=["prefill-4-tokens", "prefill-and-decodes", "prefill-and-q2-request"])
def test_mixed_batch_in_the_decode_range_gets_the_reference_answer(compiled, context_lens, query_lens):
    gen = torch.Generator().manual_seed(sum(query_lens))
    ids, meta = _step(compiled, gen, context_lens, query_lens)
    assert meta.num_tokens <= MAX_TOKENS and (meta.num_prefills or meta.query_len != 1)
    check = run_checked(compiled, ids, meta)
    # The fused ops exist only in the [1, 16] artifact: it ran, and its ops took the general path.
    assert check.fused_runs == {"dense": 1, "sparse": 1}
    assert check.error < TOLERANCE and check.caches_match


@pytest.mark.parametrize("context_lens,query_lens", [([0], [20]), ([2 * i + 1 for i in range(17)], 1)],
                         ids=["prefill-20-tokens", "decode-17-requests"])
def test_larger_steps_run_the_untouched_range(compiled, context_lens, query_lens):
    gen = torch.Generator().manual_seed(7)
    ids, meta = _step(compiled, gen, context_lens, query_lens)
    assert meta.num_tokens > MAX_TOKENS
    check = run_checked(compiled, ids, meta)
    assert check.fused_runs == {"dense": 0, "sparse": 0}
    assert check.error < TOLERANCE and check.caches_match


# ---- (e) deployment refusals from real VllmConfigs -------------------------------------------------------


@pytest.mark.parametrize("parts,fragment", [
    # tiny's experts (intermediate 32) do not split into whole MX blocks at TP 2
    (lambda: {"parallel_config": ParallelConfig(tensor_parallel_size=2)},
     "the model does not split for tensor parallelism: tensor_parallel_size=2"),
    (lambda: {"parallel_config": ParallelConfig(enable_expert_parallel=True)}, "expert parallelism is enabled"),
    (lambda: {"cache_config": CacheConfig(cache_dtype="fp8_e5m2", block_size=BS)}, "kv cache dtype 'fp8_e5m2' is not supported"),
    (lambda: {"cache_config": CacheConfig(block_size=64)}, "cache block size 64 differs from the model's sparse "
                                                             "block size 16"),
    (lambda: {"attention_config": AttentionConfig(indexer_kv_dtype="mxfp4")},
     "index cache dtype 'mxfp4' is not supported"),
    (lambda: {"compilation_config": CompilationConfig(splitting_ops=["minimax::sparse_attention_decode"])},
     "splitting_ops ['minimax::sparse_attention_decode'] split decode layers apart"),
], ids=["tp2-unsplittable", "expert-parallel", "kv-fp8-e5m2", "block-size", "indexer-mxfp4", "splitting-ops"])
def test_refused_vllm_deployments_give_a_clear_reason(isolated_caches, parts, fragment):
    config = vllm_config(**parts())
    reason = deployment_refusal(deployment_from_vllm_config(config, CFG))
    assert reason is not None and fragment in reason, reason


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=4),
                                      dict(pipeline_parallel_size=2), dict(data_parallel_size=2)],
                         ids=["tp2", "tp4", "pp2", "dp2"])
def test_tensor_pipeline_and_data_parallelism_are_served(isolated_caches, parallel):
    model = preset("tiny_tp")
    config = vllm_config(parallel_config=ParallelConfig(**parallel),
                         cache_config=CacheConfig(block_size=model.sparse_block_size))
    deployment = deployment_from_vllm_config(config, model)
    assert deployment_refusal(deployment) is None


def test_piecewise_cudagraphs_are_refused(isolated_caches):
    config = vllm_config()
    # This platform forces every CUDA-graph mode to NONE while building the config; a GPU keeps it.
    config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    reason = deployment_refusal(deployment_from_vllm_config(config, CFG))
    assert reason is not None and "piecewise CUDA graphs" in reason
    for mode in (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.NONE):
        config.compilation_config.cudagraph_mode = mode
        assert deployment_refusal(deployment_from_vllm_config(config, CFG)) is None, mode
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    assert deployment_refusal(deployment_from_vllm_config(config, CFG)) is not None


def test_full_cudagraphs_are_refused(vllm, isolated_caches):
    """FULL replays one capture for decode and mixed batches alike: refused by the pass and the wrapper."""
    config = vllm_config()
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    reason = deployment_refusal(deployment_from_vllm_config(config, CFG))
    assert reason is not None and "FULL_DECODE_ONLY" in reason and "mixed" in reason
    with set_current_vllm_config(config), pytest.raises(ValueError, match="cudagraph_mode: FULL"):
        MiniMaxM3VllmModel(vllm_config=config, config=CFG, num_blocks=8)


def test_default_vllm_deployment_is_served(isolated_caches):
    d = deployment_from_vllm_config(vllm_config(), CFG)
    assert deployment_refusal(d) is None
    # No ModelConfig: max_model_len is unknown, "auto" names no dtype, the indexer default is bf16.
    assert (d.block_size, d.kv_cache_dtype, d.index_cache_dtype, d.max_model_len) == (16, "auto", "bf16", None)


def test_fp8_kv_deployment_refuses_a_bf16_cache_and_the_wrapper_allocates_fp8(isolated_caches):
    config = vllm_config(cache_config=CacheConfig(cache_dtype="fp8", block_size=BS),
                         attention_config=AttentionConfig(indexer_kv_dtype="fp8"))
    d = deployment_from_vllm_config(config, CFG)
    assert deployment_refusal(d) is None  # fp8 e4m3 is served, as long as the traced cache holds it
    assert d.cache_dtype("kv") == d.cache_dtype("index") == torch.float8_e4m3fn
    with FakeTensorMode():
        step = dict(x=torch.empty(4, CFG.hidden_size, dtype=torch.bfloat16), query_len=1,
                    positions=torch.empty(4, dtype=torch.int64), slot_mapping=torch.empty(4, dtype=torch.int64),
                    block_table=torch.empty(4, 4, dtype=torch.int32), seq_lens=torch.empty(4, dtype=torch.int32),
                    kv_cache=torch.empty(8, 2, BS, 64, dtype=torch.bfloat16))
    reason = step_refusal(step, d)
    assert reason == "kv_cache holds torch.bfloat16 but the deployment's kv cache dtype is torch.float8_e4m3fn"
    with set_current_vllm_config(config):
        model = MiniMaxM3VllmModel(vllm_config=config, config=CFG, num_blocks=4)
    caches = model.layer_caches()
    assert {c.kv.dtype for c in caches} == {torch.float8_e4m3fn}
    assert [c.index.dtype for c in caches if c.index is not None] == [torch.float8_e4m3fn]


def test_model_config_from_a_minimax_m3_hf_config(isolated_caches, tmp_path):
    config = vllm_config(model_config=minimax_model_config(tmp_path, max_model_len=MAX_LEN),
                         cache_config=CacheConfig(block_size=64))
    assert minimax_m3_config_from_vllm(config) == CFG
    d = deployment_from_vllm_config(config)  # no model config given: parsed from hf_config
    assert d.model_config == CFG and d.kv_cache_dtype == "bfloat16"  # "auto" = the model dtype
    assert "differs from the model's sparse block size 16" in deployment_refusal(d)


def test_max_model_len_beyond_the_fused_limit_is_refused(isolated_caches, tmp_path):
    long = CFG.replace(max_position_embeddings=2 * MAX_CONTEXT)
    config = vllm_config(model_config=minimax_model_config(tmp_path, long, max_model_len=MAX_CONTEXT + BS))
    reason = deployment_refusal(deployment_from_vllm_config(config))
    assert reason == f"max_model_len={MAX_CONTEXT + BS} exceeds the fused decode's limit of {MAX_CONTEXT} tokens"


def test_refusal_is_logged_once_by_the_pass(isolated_caches, caplog):
    config = vllm_config(parallel_config=ParallelConfig(enable_expert_parallel=True))
    p = MiniMaxM3DecodePass()
    with set_current_vllm_config(config):  # as PostGradPassManager.configure sets it
        for _ in range(3):
            p(fx.Graph())
    reasons = _reasons(caplog)
    assert len(reasons) == 1 and reasons[0].startswith("fused decode refused for this deployment: expert parallelism")
    assert p.rewrites == 0 and p.calls == 3


# ---- (f) the pass object: pickling, deep copies, uuid ---------------------------------------------------


def test_pass_pickles_and_deepcopies_with_a_config_current(isolated_caches, compiled):
    with set_current_vllm_config(vllm_config()):
        for p in (graph_passes.minimax_m3_decode_pass, compiled.graph_pass):
            data = pickle.dumps(p)
            assert b"pattern_matcher" not in data and b"PatternMatcher" not in data
            for clone in (pickle.loads(data), copy.deepcopy(p)):
                assert type(clone) is type(p) and clone.uuid() == p.uuid()
                assert clone.graphs == []  # recorded graph text is not configuration
        # Configuration and counters only: nothing built from graphs (no pattern matcher) travels.
        state = vars(pickle.loads(pickle.dumps(graph_passes.minimax_m3_decode_pass)))
        assert all(isinstance(v, (type(None), bool, int, list, Deployment)) for v in state.values()), state


def test_uuid_follows_the_current_vllm_config(isolated_caches):
    p = graph_passes.minimax_m3_decode_pass
    uuids = {}
    for name, parts in {"default": {}, "default-again": {},
                        "fp8": {"cache_config": CacheConfig(cache_dtype="fp8", block_size=BS)},
                        "tp2": {"parallel_config": ParallelConfig(tensor_parallel_size=2)}}.items():
        with set_current_vllm_config(vllm_config(**parts)):
            uuids[name] = p.uuid()
    assert uuids["default"] == uuids["default-again"]
    assert len({uuids["default"], uuids["fp8"], uuids["tp2"]}) == 3
    assert p.uuid() not in uuids.values()  # no config current: the permissive default Deployment
    assert p.uuid() == MiniMaxM3DecodePass(Deployment()).uuid()


def test_pass_uuid_reaches_vllms_config_hash(isolated_caches):
    """vLLM hashes the pass through uuid() into its compile-cache key: a changed pass source or
    deployment gives a different cache directory, never a stale artifact."""
    base = vllm_config(MiniMaxM3DecodePass()).compute_hash()
    assert vllm_config(MiniMaxM3DecodePass()).compute_hash() == base
    assert vllm_config(MiniMaxM3DecodePass(Deployment(kv_cache_dtype="fp8"))).compute_hash() != base


def test_vllm_config_errors_surface(isolated_caches, monkeypatch):
    """Only 'vLLM not in use / no config current' makes the pass fall back to the default Deployment:
    a failure while reading a current config propagates instead of silently allowing the fusion."""
    def broken(vllm_config, model_config=None):
        raise RuntimeError("broken config reader")

    monkeypatch.setattr(vllm_config_module, "deployment_from_vllm_config", broken)
    assert MiniMaxM3DecodePass().uuid()  # no config current: never read
    with set_current_vllm_config(vllm_config()), pytest.raises(RuntimeError, match="broken config reader"):
        MiniMaxM3DecodePass().uuid()
