"""MiniMax-M3 through vLLM's real engine on CPU with tensor_parallel_size=2 and with
pipeline_parallel_size=2, the fused decode pass on: the greedy tokens must be the project's TP 1
reference model's choices, but for near-ties (vllm_checkpoint.assert_reference_greedy, as for the TP 1
engine: test_vllm_engine.py), and in every worker the pass must have fused its layers and the fused ops
must have run on their fused path.

The checkpoint is the VL-layout tiny model of vllm_checkpoint.py with intermediate sizes that split
into whole MX blocks at TP 2. vLLM starts one worker process per rank (its multiprocessing executor);
they find the plugin through its ``vllm.general_plugins`` entry point (the installed package's, else
pyproject.toml's written as metadata onto their sys.path: vllm_support.entry_point_folder), and their OpenMP
threads are left unbound (one NUMA node here). The workers are asked for their counters through
``LLM.collective_rpc``.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from vllm_checkpoint import TINY, assert_reference_greedy, write_checkpoint
from vllm_support import entry_point_folder, isolate_compile_caches, require_vllm

CFG = TINY.replace(intermediate_size=64, shared_intermediate_size=64)  # 32 per rank at TP 2
PROMPT_LENS = (57, 130, 250)  # 1, 2 and 2 blocks of 128 tokens; the last crosses into a third while decoding
MAX_TOKENS_OUT = 8
PASS = "graph_passes.minimax_m3_decode_pass"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    require_vllm()
    root = tmp_path_factory.mktemp("vllm_parallel")
    plugin = entry_point_folder(root)
    with pytest.MonkeyPatch.context() as mp:
        isolate_compile_caches(mp, root)
        paths = [REPO, os.path.join(REPO, "tests")] + ([str(plugin)] if plugin else [])
        mp.setenv("PYTHONPATH", os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]))
        if plugin:
            mp.syspath_prepend(str(plugin))  # spawned processes start from the parent's sys.path
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core here; workers are processes
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from minimax_vllm.plugin import register
        register()
        ckpt = root / "ckpt"
        weights = write_checkpoint(ckpt, CFG)
        yield ckpt, weights


def _worker_counts(worker) -> dict:
    """In a vLLM worker: its rank, the pass's fused layers and the fused ops' fused-path runs."""
    from minimax_ops.ops import fused as fused_ops

    graph_pass = worker.vllm_config.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
    return {"rank": worker.rank, "rewrites": graph_pass.rewrites,
            "fused": {k: fused_ops.impl_calls[k] - fused_ops.fallback_calls[k] for k in fused_ops.impl_calls}}


@pytest.mark.slow
@pytest.mark.parametrize("parallel,per_worker", [
    ({"tensor_parallel_size": 2}, [{"dense": 2, "sparse": 2}] * 2),  # every rank runs every layer
    ({"pipeline_parallel_size": 2}, [{"dense": 2, "sparse": 0}, {"dense": 0, "sparse": 2}]),  # a stage its layers
], ids=["tp2", "pp2"])
def test_parallel_engine_matches_the_tp1_reference(env, parallel, per_worker):
    from vllm import LLM, SamplingParams

    ckpt, weights = env
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    torch._dynamo.reset()
    llm = LLM(model=str(ckpt), skip_tokenizer_init=True, dtype="bfloat16", block_size=128, max_model_len=1024,
              max_num_seqs=4, max_num_batched_tokens=1024, seed=0, distributed_executor_backend="mp",
              compilation_config={"mode": 3, "cudagraph_mode": "NONE", "splitting_ops": [], "compile_sizes": [],
                                  "compile_ranges_endpoints": [16],
                                  "inductor_passes": {"post_grad_custom_post_pass": PASS},
                                  "inductor_compile_config": {"fx_graph_cache": False}}, **parallel)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS_OUT, detokenize=False,
                                           ignore_eos=True), use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        counts = sorted(llm.collective_rpc(_worker_counts), key=lambda c: c["rank"])
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    for prompt, tokens in zip(prompts, got, strict=True):
        assert len(tokens) == MAX_TOKENS_OUT
        assert_reference_greedy(weights, CFG, prompt, tokens)
    assert len(counts) == 2
    for c, layers in zip(counts, per_worker, strict=True):
        assert c["rewrites"] == sum(layers.values()), c  # the pass fused each of the worker's layers
        # Decode steps after the first token (a prefill): every one ran each held layer fused.
        steps = MAX_TOKENS_OUT - 1
        assert {k: v // steps for k, v in c["fused"].items()} == layers and \
            all(v % steps == 0 for v in c["fused"].values()), c
