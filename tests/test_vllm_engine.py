"""MiniMax-M3 served by vLLM's real engine (vllm.LLM) on CPU, with the fused decode pass.

A tiny random checkpoint laid out as the official VL release (vllm_checkpoint.py: 2 dense + 2 sparse
MoE layers, head_dim and block size 128, top-2 blocks) is served through the plugin's model class
(minimax_vllm.model.MiniMaxM3ForVllm): vLLM loads its weights, allocates and binds the KV and index
caches, schedules the requests and builds each step's metadata. Greedy tokens must be the choices of the
project's reference model decoding the same checkpoint, but for near-ties that bf16 rounding tips
either way (vllm_checkpoint.assert_reference_greedy), and the pass must have run and fused every layer,
on both routes vLLM's CPU platform can take:

- trace-once (what the platform turns VLLM_COMPILE into): one dynamic graph for every step size;
- VLLM_COMPILE kept (vllm_support.forced_vllm_compile): vLLM's pass manager, compile ranges [1, 16] and
  [17, max_num_batched_tokens], the pass applied to the first only.

A third engine runs ngram speculative decoding (2 speculative tokens: query_len 3 decode steps) with a
KV cache so small that vLLM preempts and recomputes requests. Engines run in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) and are shared by the cases of each route.
"""

from __future__ import annotations

import gc

import pytest
import torch

from minimax_ops.loader import load_weights
from minimax_ops.ops import fused as fused_ops
from test_checkpoint_layouts import transformers_form
from transformers_reference import transformers_steps
from vllm_checkpoint import TINY, assert_greedy, assert_reference_greedy, decisive_prompts, write_checkpoint
from vllm_support import NO_VLLM_FUSIONS, forced_vllm_compile, isolate_compile_caches, require_vllm

MAX_TOKENS_OUT = 16
SPEC_TOKENS_OUT = 48
# Different lengths: one block, crossing blocks 1->2 and 2->3 while decoding, and more blocks than top-k.
PROMPT_LENS = (57, 120, 250, 380)
PASS = "graph_passes.minimax_m3_decode_pass"


def prompts(seed: int = 1, lens=PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in lens]


def repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so that ngram lookup proposes draft tokens."""
    g = torch.Generator().manual_seed(2)
    out = []
    # Two blocks each, all admitted into 7 blocks; growing past 256 tokens they need 3 blocks more.
    for n, period in ((250, 7), (245, 11), (240, 5)):
        unit = torch.randint(0, TINY.vocab_size, (period,), generator=g).tolist()
        out.append((unit * (n // period + 1))[:n])
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    require_vllm()
    root = tmp_path_factory.mktemp("vllm_engine")
    with pytest.MonkeyPatch.context() as mp:
        isolate_compile_caches(mp, root)
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine and worker in this process
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        from minimax_vllm.plugin import register
        register()  # what the vllm.general_plugins entry point does in each vLLM process
        yield root, mp


@pytest.fixture(scope="module")
def checkpoint(env):
    root, _ = env
    path = root / "ckpt"
    write_checkpoint(path)
    config, weights = load_weights(path)  # the reference reads the same files (VL layout) through loader.py
    assert config == TINY
    return path, weights


@pytest.fixture(scope="module")
def follows_reference(checkpoint):
    """Asserts that an engine's greedy outputs for a batch of prompts are the reference's
    (vllm_checkpoint.assert_reference_greedy)."""
    _, weights = checkpoint

    def check(batch: list[list[int]], outputs: list[list[int]], max_tokens: int = MAX_TOKENS_OUT) -> None:
        assert len(outputs) == len(batch)
        for prompt, tokens in zip(batch, outputs):
            assert len(tokens) == max_tokens
            assert_reference_greedy(weights, TINY, prompt, tokens)
    return check


class Engine:
    def __init__(self, path, **kwargs):
        from vllm import LLM

        torch._dynamo.reset()
        compilation = {"mode": 3, "cudagraph_mode": "NONE", "splitting_ops": [], "compile_sizes": [],
                       "compile_ranges_endpoints": [16], "inductor_passes": {"post_grad_custom_post_pass": PASS},
                       "inductor_compile_config": {"fx_graph_cache": False},
                       **kwargs.pop("compilation", {})}
        args = dict(skip_tokenizer_init=True, dtype="bfloat16", block_size=128, max_model_len=1024, max_num_seqs=4,
                    max_num_batched_tokens=1024, seed=0, compilation_config=compilation)
        self.llm = LLM(model=str(path), **{**args, **kwargs})
        self.config = self.llm.llm_engine.vllm_config
        self.graph_pass = self.config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]

    def generate(self, prompts: list[list[int]], max_tokens: int = MAX_TOKENS_OUT) -> tuple[list[list[int]], dict]:
        """Greedy tokens, and the fused ops' runs on their fused path (not falling back) meanwhile."""
        from vllm import SamplingParams

        before = {k: fused_ops.impl_calls[k] - fused_ops.fallback_calls[k] for k in fused_ops.impl_calls}
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False,
                                                ignore_eos=True), use_tqdm=False)
        fused = {k: fused_ops.impl_calls[k] - fused_ops.fallback_calls[k] - before[k] for k in before}
        return [list(o.outputs[0].token_ids) for o in outs], fused

    def close(self):
        del self.llm
        gc.collect()


def engine_fixture(**kwargs):
    @pytest.fixture(scope="module")
    def fixture(env, checkpoint):
        _, mp = env
        with forced_vllm_compile(mp) if kwargs.pop("force", False) else _nothing():
            engine = Engine(checkpoint[0], **kwargs)
        yield engine
        engine.close()
    return fixture


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


trace_once = engine_fixture()
vllm_compile = engine_fixture(force=True, compilation={"pass_config": NO_VLLM_FUSIONS})
# 7 blocks of 128 tokens for 3 requests of 2-3 blocks
speculative_tiny_cache = engine_fixture(
    speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                        "prompt_lookup_max": 4},
    num_gpu_blocks_override=7, max_model_len=512, disable_log_stats=False)


# ---- the trace-once route (vLLM's CPU platform default) ----------------------------------------------------


def test_trace_once_route_fuses_every_layer_and_matches_the_reference(trace_once, follows_reference):
    from vllm.config import CompilationMode

    assert trace_once.config.compilation_config.mode == CompilationMode.DYNAMO_TRACE_ONCE
    batch = prompts()
    tokens, fused = trace_once.generate(batch)
    assert trace_once.graph_pass.calls == 1  # one dynamic graph serves every step
    assert trace_once.graph_pass.rewrites == TINY.num_hidden_layers  # 2 dense + 2 sparse layers fused
    assert fused["dense"] > 0 and fused["sparse"] > 0  # decode steps ran the fused ops
    follows_reference(batch, tokens)


def test_trace_once_route_serves_a_second_batch(trace_once, follows_reference):
    batch = prompts(seed=5, lens=(130, 9))
    tokens, fused = trace_once.generate(batch)
    assert fused["sparse"] > 0 and trace_once.graph_pass.calls == 1  # no recompilation
    follows_reference(batch, tokens)


def test_transformers_minimax_m3_is_a_second_reference(trace_once, checkpoint):
    """transformers' own MiniMax-M3 (weights mapped from the release's names) takes the engine's tokens as
    its greedy choices, for prompts of one block and of more blocks than top-k (selection matters), whose
    greedy path under the reference is decisive at bf16 precision. Its logits are bf16, so two of them
    may tie: assert_greedy lets a tie (or a near-tie) go either way, and follows the engine's tokens."""
    from safetensors.torch import load_file

    from minimax_ops.loader import text_model_tensors

    path, weights = checkpoint
    tensors = text_model_tensors(load_file(str(path / "model.safetensors")))
    cases = decisive_prompts(weights, TINY, (250, 380, 57), MAX_TOKENS_OUT, seed=7)
    tokens, _ = trace_once.generate([prompt for prompt, _ in cases])
    text = transformers_form(TINY)["text_config"]
    for (prompt, reference_tokens), engine_tokens in zip(cases, tokens):
        assert engine_tokens == reference_tokens  # no near-tie on this path for rounding to tip
        assert_greedy(prompt, engine_tokens, transformers_steps(tensors, TINY, text, prompt, engine_tokens),
                      "transformers' MiniMaxM3VLForCausalLM")


# ---- VLLM_COMPILE kept: vLLM's pass manager and compile ranges ----------------------------------------------


def test_vllm_compile_route_fuses_every_layer_and_matches_the_reference(vllm_compile, follows_reference):
    from vllm.config import CompilationMode

    assert vllm_compile.config.compilation_config.mode == CompilationMode.VLLM_COMPILE
    batch = prompts()
    tokens, fused = vllm_compile.generate(batch)
    # The pass rewrote the [1, 16] range's graph only (the larger range is compiled untouched).
    assert vllm_compile.graph_pass.rewrites == TINY.num_hidden_layers
    assert fused["dense"] > 0 and fused["sparse"] > 0
    follows_reference(batch, tokens)


# ---- speculative decoding (query_len 3) with preemption ------------------------------------------------------


def test_ngram_speculation_with_preemption_matches_the_reference(speculative_tiny_cache, follows_reference):
    engine = speculative_tiny_cache
    text = engine.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model.text
    assert text.decode_query_len == 3  # the graph holds the decode chain of 1 + 2 speculative tokens
    batch = repetitive_prompts()
    # Long enough for the greedy outputs to turn periodic, where ngram lookup drafts for every request.
    tokens, fused = engine.generate(batch, SPEC_TOKENS_OUT)
    assert engine.graph_pass.rewrites == TINY.num_hidden_layers
    assert fused["sparse"] > 0  # uniform 3-token decode steps took the fused path
    metrics = engine.llm.get_metrics()
    preemptions = sum(m.value for m in metrics if m.name == "vllm:num_preemptions")
    assert preemptions > 0, f"the tiny KV cache was meant to make vLLM preempt: {[m.name for m in metrics]}"
    follows_reference(batch, tokens, SPEC_TOKENS_OUT)
