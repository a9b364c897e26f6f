"""Test helpers shared by the vLLM test files: vLLM required in CI, VLLM_COMPILE kept on the CPU
platform, isolated compile caches."""

from __future__ import annotations

import os
import pathlib
import tomllib
from contextlib import contextmanager
from importlib.metadata import entry_points

import pytest


# Only the decode pass: vLLM's own fusions need its CUDA ops.
NO_VLLM_FUSIONS = dict(fuse_norm_quant=False, fuse_act_quant=False, fuse_attn_quant=False, fuse_allreduce_rms=False,
                       enable_qk_norm_rope_fusion=False, fuse_rope_kvcache_cat_mla=False, fuse_act_padding=False,
                       fuse_mla_dual_rms_norm=False, fuse_rope_kvcache=False, fuse_qk_norm_rope_kvcache=False,
                       eliminate_noops=True)


def require_vllm():
    """vLLM, or a skip outside CI; in CI (CI=true, where .ci/run installs it) a missing vLLM fails."""
    if os.environ.get("CI", "").lower() == "true":
        import vllm  # noqa: F401  (ImportError fails the test: CI must run these tests)
        return vllm
    return pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it: .ci/install-vllm)")


@contextmanager
def forced_vllm_compile(monkeypatch: pytest.MonkeyPatch):
    """Keep compilation mode VLLM_COMPILE on vLLM's CPU platform, whose check_and_update_config turns
    it into the trace-once mode (one dynamic graph, no pass manager); a no-op on other platforms."""
    from vllm.config import CompilationMode
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if not current_platform.is_cpu():
        yield
        return
    original = platform.check_and_update_config

    def keep_vllm_compile(cls, vllm_config):
        mode = vllm_config.compilation_config.mode
        original(vllm_config)
        if mode == CompilationMode.VLLM_COMPILE:
            vllm_config.compilation_config.mode = mode

    with monkeypatch.context() as mp:  # undone on leaving, not when the (module-scoped) monkeypatch ends
        mp.setattr(platform, "check_and_update_config", classmethod(keep_vllm_compile))
        yield


def isolate_compile_caches(monkeypatch: pytest.MonkeyPatch, root) -> None:
    """Fresh compile caches: a cached artifact would skip the pass."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root / "vllm"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")  # also turns vLLM's AOT compile off


def entry_point_folder(tmp_path: pathlib.Path) -> pathlib.Path | None:
    """A folder holding pyproject.toml's declared entry point as distribution metadata, or None when the
    package is installed: put it on a process's path and vLLM's plugin loader finds the project."""
    if any(e.name == "minimax_ops" for e in entry_points(group="vllm.general_plugins")):
        return None
    pyproject = pathlib.Path(__file__).parents[1] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["entry-points"]
    info = tmp_path / "meta" / "minimax_m3_ops_uninstalled-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: minimax-m3-ops-uninstalled\nVersion: 0.0\n")
    lines = ["[vllm.general_plugins]"] + [f"{k} = {v}" for k, v in declared["vllm.general_plugins"].items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return info.parent
