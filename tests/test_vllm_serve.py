"""vLLM's OpenAI server (`vllm serve`) of the tiny VL-layout checkpoint on 127.0.0.1, queried with the
openai client.

The server is a separate process tree (API server + engine core), started and stopped here within a
time bound. It finds the project the way a deployer's install does: through the `vllm.general_plugins`
entry point (an installed package's, or, when the package is not installed, the one pyproject.toml
declares, written as package metadata into a temporary folder on the server's PYTHONPATH).
Greedy completions (token ids in, token ids out) must equal the reference model's greedy tokens (for
prompts whose greedy path is decisive at bf16 precision: vllm_checkpoint.decisive_prompts).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from vllm_checkpoint import TINY, decisive_prompts, write_checkpoint
from vllm_support import entry_point_folder, require_vllm

ROOT = pathlib.Path(__file__).parents[1]
START_TIMEOUT_S = 420  # engine start with compilation on 2 busy cores
MAX_TOKENS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, port: int, log: pathlib.Path) -> None:
    import urllib.request

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    pytest.fail(f"vllm serve not healthy after {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_vllm_serve_greedy_completions_match_the_reference(tmp_path):
    require_vllm()
    import openai

    ckpt = tmp_path / "ckpt"
    weights = write_checkpoint(ckpt)
    paths = [str(ROOT)] + [str(p) for p in [entry_point_folder(tmp_path)] if p is not None]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]),
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "VLLM_DISABLE_COMPILE_CACHE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    port = _free_port()
    compilation = {"mode": 3, "cudagraph_mode": "FULL_DECODE_ONLY", "splitting_ops": [],
                   "compile_ranges_endpoints": [16],
                   "inductor_passes": {"post_grad_custom_post_pass": "graph_passes.minimax_m3_decode_pass"}}
    # `vllm serve`'s server. Not through the `vllm` CLI: on vllm-cpu 0.32.0 it looks up the version of a
    # distribution named "vllm" (this one is "vllm-cpu") and exits; the API-server module is the same server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--host", "127.0.0.1",
           "--port", str(port), "--skip-tokenizer-init", "--block-size", "128", "--max-model-len", "1024",
           "--max-num-seqs", "4", "--dtype", "bfloat16", "-cc", json.dumps(compilation)]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(proc, port, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        for prompt, want in decisive_prompts(weights, TINY, (40, 200), MAX_TOKENS, seed=3):
            r = client.completions.create(model=str(ckpt), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
            assert r.choices[0].token_ids == want
    finally:
        _stop(proc)
    text = log.read_text()
    assert "minimax_ops serves MiniMaxM3SparseForCausalLM" in text  # the plugin announced itself
    assert "fused decode refused" not in text and "fused decode off" not in text
