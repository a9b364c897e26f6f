"""The SASS check for writes to an in-flight wgmma's A registers (kernels/wgmma_hazards.py), on
hand-written SASS in nvdisasm's form; aot_check runs it on every CUDA kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minimax_ops.kernels.cubin_resources import bundled_tool
from minimax_ops.kernels.wgmma_hazards import find_hazards, written_registers


def sass(*lines: str) -> str:
    """nvdisasm -c lines: labels as given, instructions at consecutive addresses."""
    out, address = [], 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{address:04x}*/                   {line} ;")
            address += 0x10
    return "\n".join(out)


def loop(tail_wait: int, *body: str) -> str:
    """A K loop: decode into R40..R43, one register-A wgmma group, wait until `tail_wait` groups remain."""
    return sass(".L_x_1:", "LDSM.16.M88.4 R40, [R79+UR8]", *body, "WARPGROUP.ARRIVE",
                "HGMMA.64x16x16.F32.BF16 R24, R40, gdesc[UR12], R24, gsb0",
                f"WARPGROUP.DEPBAR.LE gsb0, 0x{tail_wait}", "@P5 BRA `(.L_x_1)", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
                "EXIT", ".L_x_2:", "BRA `(.L_x_2)")


def test_group_left_in_flight_across_the_back_edge_is_a_race():
    hazards = find_hazards(loop(1))
    assert [(h.write.text.split(" ")[0], h.registers) for h in hazards] == [("LDSM.16.M88.4", (40, 41, 42, 43))]
    assert hazards[0].wgmma == 0x20  # the HGMMA's address


def test_group_retired_before_the_next_decode_is_fine():
    assert find_hazards(loop(0)) == []


def test_smem_operand_wgmma_has_no_register_a():
    text = loop(1).replace("R24, R40, gdesc[UR12]", "R24, gdesc[UR4], gdesc[UR12]")
    assert find_hazards(text) == []


def test_write_to_other_registers_or_guarded_never_is_fine():
    text = sass("WARPGROUP.ARRIVE", "HGMMA.64x16x16.F32.BF16 R24, R40, gdesc[UR12], R24, gsb0",
                "IMAD.MOV.U32 R44, RZ, RZ, R3", "@!PT LDS R40, [RZ]", "STS.128 [R40], R40",
                "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MOV R40, R3", "EXIT")
    assert find_hazards(text) == []


def test_write_within_the_open_group_counts():
    text = sass("WARPGROUP.ARRIVE", "HGMMA.64x16x16.F32.BF16 R24, R40, gdesc[UR12], R24",
                "HMUL2.BF16_V2 R42, R3, R4.H0_H0", "HGMMA.64x16x16.F32.BF16 R24, R56, gdesc[UR12], R24, gsb0",
                "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT")
    assert [h.registers for h in find_hazards(text)] == [(42,)]


def test_conditional_exit_path_keeps_walking():
    text = sass("WARPGROUP.ARRIVE", "HGMMA.64x16x16.F32.BF16 R24, R40, gdesc[UR12], R24, gsb0", "@P0 EXIT",
                "IADD3 R43, R1, 0x1, RZ", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT")
    assert [h.registers for h in find_hazards(text)] == [(43,)]


@pytest.mark.parametrize("text, regs", [("LDSM.16.M88.4 R8, [R1]", (8, 9, 10, 11)), ("LDS.64 R8, [R1]", (8, 9)),
                                        ("IMAD.WIDE R8, R1, 0x4, R2", (8, 9)), ("LDG.E.128 R12, desc[UR4][R2.64]",
                                                                                (12, 13, 14, 15)),
                                        ("STS.128 [R8], R12", ()), ("ISETP.GE.AND P5, PT, R1, R2, PT", ()),
                                        ("F2FP.BF16.F32.PACK_AB R7, R1, R2", (7,)),
                                        ("SHFL.BFLY PT, R3, R2, 0x1, 0x1f", (3,)),
                                        ("HMMA.16816.F32.BF16 R4, R8, R12, R4", (4, 5, 6, 7))])
def test_written_registers(text, regs):
    assert written_registers(text) == regs


def test_nvdisasm_ships_with_triton():
    """aot_check disassembles every CUDA kernel with it: CI must have it."""
    assert bundled_tool("nvdisasm") is not None


# The expert w2 kernel at the tiles that raced on the H200 (MXFP4, 128 x 64, 3 stages, weights as A),
# compiled for sm_90 with mx_decode._mma as it is (each wgmma waited for in its K step) or as it was
# (the product left in flight into the next step). A fresh Triton cache: the compiler must really run.
RACE_PROBE = textwrap.dedent("""
    import dataclasses, sys
    import triton, triton.language as tl
    from minimax_ops.kernels import aot_check, moe, mx_decode

    @triton.jit
    def _mma_left_in_flight(acc, x, w, SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr):
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        return acc

    if sys.argv[1] == "in_flight":
        mx_decode._mma = _mma_left_in_flight
    spec = next(s for s in moe.aot_specs() if s.label() == "moe_w2_mxfp4_h6144_merged_n128k64x1s1")
    spec = dataclasses.replace(spec, constexprs={**spec.constexprs, "SWAP_AB": True})
    try:
        aot_check.compile_spec(spec, ("cuda", 90, 32))
        print("CLEAN")
    except RuntimeError as e:
        print("REFUSED", e)
""")


@pytest.mark.parametrize("form, verdict", [("as_is", "CLEAN"), ("in_flight", "REFUSED wgmma register race")])
def test_aot_check_refuses_the_race_in_real_compiler_output(form, verdict, tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    probe = tmp_path / "race_probe.py"  # (@triton.jit wants its source in a file)
    probe.write_text(RACE_PROBE)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(probe), form], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.stdout.startswith(verdict), done.stdout + done.stderr[-2000:]
