"""What one program of a compiled sm_90 kernel holds (registers, stack, shared memory), read offline from its
cubin, and how many programs an SM can keep resident: under PDL this decides whether a dependent's
programs start beside its predecessor's or only as they exit.

Read it from a compile that specialises like a launch (aot_check's, with 16-byte divisible pointers and
strides): without those hints loads are not vectorised and the same kernels compile to up to 255 registers
instead of ~165 (BENCHMARKS.md, twenty-seventh session).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class SmLimits:
    """Per-SM residency limits of a GPU generation (CUDA occupancy rules)."""
    registers: int  # 32-bit registers an SM holds
    register_unit: int  # registers are given to a warp in units of this many
    warps: int
    programs: int
    shared: int  # bytes of shared memory programs may take, at the largest carveout
    reserved_shared: int  # bytes the driver keeps per resident program


HOPPER = SmLimits(registers=65536, register_unit=256, warps=64, programs=32, shared=228 * 1024,
                  reserved_shared=1024)


@dataclass(frozen=True)
class Resources:
    registers: int  # a thread's
    stack: int  # bytes a thread (spills and local arrays)
    shared: int  # bytes a program: static (the cubin's) plus Triton's dynamic
    num_warps: int

    def program_registers(self, limits: SmLimits = HOPPER) -> int:
        per_warp = -(-self.registers * 32 // limits.register_unit) * limits.register_unit
        return per_warp * self.num_warps

    def __str__(self) -> str:
        return (f"regs {self.registers} stack {self.stack} smem {self.shared} "
                f"({programs_per_sm(self)} a SM)")


_FUNCTION = re.compile(r"Function\s+(\S+):")
_FIELD = re.compile(r"\b(REG|STACK|SHARED|LOCAL):(\d+)")


def parse_resource_usage(text: str) -> dict[str, dict[str, int]]:
    """``cuobjdump --dump-resource-usage`` output -> {function: {"REG": .., "STACK": .., "SHARED": .., ...}}."""
    out, current = {}, None
    for line in text.splitlines():
        found = _FUNCTION.search(line)
        if found:
            current = found.group(1)
            continue
        fields = dict((k, int(v)) for k, v in _FIELD.findall(line))
        if current is not None and "REG" in fields:
            out[current] = fields
            current = None
    return out


def bundled_tool(name: str) -> str | None:
    """Triton's bundled CUDA binary tool ``name`` (cuobjdump, nvdisasm: they work without a GPU), or None."""
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.access(path, os.X_OK) else None


def run_on_cubin(tool_name: str, *options: str, cubin: bytes) -> str:
    """The standard output of Triton's bundled ``tool_name`` run with ``options`` on a cubin (written to a
    temporary file); RuntimeError if the tool is not there."""
    tool = bundled_tool(tool_name)
    if tool is None:
        raise RuntimeError(f"{tool_name} not found beside triton (triton/backends/nvidia/bin)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *options, f.name], capture_output=True, text=True, check=True).stdout


def cubin_resources(cubin: bytes, name: str, dynamic_shared: int, num_warps: int) -> Resources:
    """The resources of kernel ``name`` in a cubin; dynamic_shared is Triton's (the compiled metadata's)."""
    usage = parse_resource_usage(run_on_cubin("cuobjdump", "--dump-resource-usage", cubin=cubin))
    if name not in usage:
        raise RuntimeError(f"cuobjdump lists no function {name!r} (it lists {sorted(usage)})")
    u = usage[name]
    return Resources(u["REG"], u.get("STACK", 0) + u.get("LOCAL", 0), u.get("SHARED", 0) + dynamic_shared, num_warps)


def programs_per_sm(r: Resources, limits: SmLimits = HOPPER, beside: tuple[tuple[Resources, int], ...] = ()) -> int:
    """Programs of r an SM can hold, alone or beside ``beside`` ((resources, resident programs) pairs);
    shared memory counted at the largest carveout (a smaller one the driver picks holds fewer)."""
    regs, warps, programs, shared = limits.registers, limits.warps, limits.programs, limits.shared
    for other, count in beside:
        regs -= other.program_registers(limits) * count
        warps -= other.num_warps * count
        programs -= count
        shared -= (other.shared + limits.reserved_shared) * count
    if min(regs, warps, programs, shared) < 0:
        return 0
    return min(regs // r.program_registers(limits), warps // r.num_warps, programs,
               shared // (r.shared + limits.reserved_shared))
