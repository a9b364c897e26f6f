"""cubin_resources: cuobjdump's resource report parsed, and the residency arithmetic that decides which
programs of two kernels share an SM (Hopper's limits)."""

from __future__ import annotations

import pytest

from minimax_ops.kernels.cubin_resources import HOPPER, Resources, bundled_tool, parse_resource_usage, programs_per_sm

REPORT = """
Resource usage:
 Common:
  GLOBAL:11 CONSTANT[4]:8
 Function _index_score_kernel:
  REG:163 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _qkv_kernel:
  REG:80 STACK:32 SHARED:4096 LOCAL:8 CONSTANT[0]:700 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_parse_resource_usage_reads_each_function():
    usage = parse_resource_usage(REPORT)
    assert sorted(usage) == ["_index_score_kernel", "_qkv_kernel"]
    assert usage["_index_score_kernel"]["REG"] == 163 and usage["_index_score_kernel"]["STACK"] == 0
    assert usage["_qkv_kernel"] == {"REG": 80, "STACK": 32, "SHARED": 4096, "LOCAL": 8}
    assert parse_resource_usage("Resource usage:\n Common:\n  GLOBAL:1\n") == {}


def test_registers_are_given_to_a_warp_in_units():
    # 163 registers a thread take 168 (5376 a warp, a multiple of 256); 80 take 80 (2560 a warp).
    assert Resources(163, 0, 0, 4).program_registers() == 4 * 5376
    assert Resources(80, 0, 0, 8).program_registers() == 8 * 2560
    assert Resources(255, 0, 0, 4).program_registers() == 4 * 8192


@pytest.mark.parametrize("qkv_programs, score_programs", [(0, 3), (1, 2), (2, 1), (3, 0)])
def test_programs_beside_a_running_kernel(qkv_programs, score_programs):
    """A 4-warp program of 163 registers beside 8-warp programs of 80: the registers decide (3 of the
    latter use 61,440 of 65,536)."""
    qkv, score = Resources(80, 32, 5120, 8), Resources(163, 0, 37888, 4)
    assert programs_per_sm(qkv) == 3
    assert programs_per_sm(score, beside=((qkv, qkv_programs),)) == score_programs


def test_each_limit_can_decide():
    assert programs_per_sm(Resources(16, 0, 0, 1)) == HOPPER.programs  # programs an SM tracks
    assert programs_per_sm(Resources(16, 0, 0, 8)) == HOPPER.warps // 8  # warps
    assert programs_per_sm(Resources(16, 0, 100 * 1024, 1)) == 2  # shared memory (+1 KB reserved each)
    assert programs_per_sm(Resources(255, 0, 0, 8)) == 1  # registers
    # A neighbour that already takes more than the SM has leaves no room at all.
    assert programs_per_sm(Resources(16, 0, 0, 1), beside=((Resources(16, 0, 0, 32), 3),)) == 0


def test_triton_bundles_the_tools_read_offline():
    """cuobjdump (resources) and nvdisasm (SASS) ship beside triton; a missing tool is None, not an error."""
    assert bundled_tool("cuobjdump") is not None and bundled_tool("nvdisasm") is not None
    assert bundled_tool("no-such-tool") is None
