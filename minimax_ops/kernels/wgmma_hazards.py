"""Hopper SASS check: no register of an in-flight wgmma's A operand is overwritten.

A wgmma whose A operand sits in registers (``HGMMA.. Rd, Ra, gdesc[..]``) reads Ra..Ra+3
asynchronously until a ``WARPGROUP.DEPBAR.LE gsb0, N`` retires its group. Triton pipelines such
dots across K-loop iterations (``warp_group_dot_wait {pendings = 1}``), and ptxas has been seen to
give the next iteration's decoded weights the registers the previous iteration's last group still
reads: results then depend on timing (the canonical-layout expert w2 kernel at 128 x 64 tiles,
3 stages, triton 3.6). This module walks a kernel's SASS (control flow included, loops to a fixed
point) and reports every instruction that writes such a register while its group may be in flight.
``aot_check`` runs it on every CUDA spec it compiles, and compiles every spec of a kernel whose compiles
issue wgmma, so CI refuses a kernel with the race.
"""

from __future__ import annotations

import dataclasses
import re

from .cubin_resources import run_on_cubin

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_REG = re.compile(r"^R(\d+)$")
_A_OPERAND = re.compile(r"^HGMMA\.\S*\s+R\d+\s*,\s*R(\d+)\s*,\s*gdesc")
_DEPBAR = re.compile(r"^WARPGROUP\.DEPBAR\.LE\s+gsb0\s*,\s*(0x[0-9a-f]+|\d+)")
# Opcodes whose first operand is not a register they write.
_NO_DEST = ("ST", "STS", "STG", "STL", "RED", "BAR", "BRA", "EXIT", "RET", "CALL", "NOP", "WARPSYNC", "MEMBAR",
            "FENCE", "DEPBAR", "LDGDEPBAR", "LDGSTS", "WARPGROUP", "BSSY", "BSYNC", "ERRBAR", "CCTL", "SYNCS",
            "UTMALDG", "UTMASTG", "UBLKCP", "ARRIVES", "YIELD", "ELECT", "VOTEU", "REDUX", "BPT", "KILL")


@dataclasses.dataclass(frozen=True)
class Instruction:
    address: int
    text: str  # without the predicate
    guarded: bool  # under a predicate: may not execute (or, for a branch, may fall through)


@dataclasses.dataclass(frozen=True)
class Hazard:
    write: Instruction
    wgmma: int  # address of the in-flight wgmma whose A registers it overwrites
    registers: tuple[int, ...]

    def __str__(self) -> str:
        regs = ", ".join(f"R{r}" for r in self.registers)
        return f"/*{self.write.address:04x}*/ {self.write.text} overwrites {regs}, A of the wgmma at /*{self.wgmma:04x}*/"


def parse(sass: str) -> tuple[list[Instruction], dict[str, int]]:
    """Instructions in address order and the index each label names."""
    code, labels = [], {}
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(code)
            continue
        m = _LINE.match(line)
        if not m:
            continue
        text = m.group(2).strip()
        guarded = text.startswith("@")
        if guarded:
            pred, _, text = text.partition(" ")
            if pred in ("@PT", "@UPT"):
                guarded = False
            elif pred in ("@!PT", "@!UPT"):
                continue  # never executes
        code.append(Instruction(int(m.group(1), 16), text.strip(), guarded))
    return code, labels


def written_registers(text: str) -> tuple[int, ...]:
    """General registers an instruction writes (its first operand), widened by its vector size."""
    opcode, _, rest = text.partition(" ")
    base = opcode.split(".")[0]
    if base in _NO_DEST or base.startswith("HGMMA"):
        return ()
    operands = [o.strip() for o in rest.split(",")]
    if len(operands) > 1 and re.match(r"^!?U?P(T|\d+)$", operands[0]):
        operands = operands[1:]  # a predicate written first (SHFL, ATOMG): the register comes next
    m = _REG.match(operands[0])
    if not m:
        return ()
    parts = opcode.split(".")
    width = 1
    if "128" in parts or (base == "LDSM" and "4" in parts) or (base in ("HMMA", "IMMA") and "F32" in parts):
        width = 4
    elif "64" in parts or "WIDE" in parts or (base == "LDSM" and "2" in parts) or base in ("HMMA", "IMMA"):
        width = 2
    r = int(m.group(1))
    return tuple(range(r, r + width))


@dataclasses.dataclass(frozen=True)
class _State:
    in_flight: tuple[tuple[int, frozenset[int]], ...] = ()  # committed groups: (first wgmma address, A regs)
    open_group: tuple[int, frozenset[int]] | None = None  # wgmmas issued since the last commit


def _step(ins: Instruction, state: _State, hazards: dict) -> _State:
    text = ins.text
    a = _A_OPERAND.match(text)
    if text.startswith("HGMMA"):
        regs = frozenset(range(int(a.group(1)), int(a.group(1)) + 4)) if a else frozenset()
        start, old = state.open_group or (ins.address, frozenset())
        group = (start, old | regs)
        if "gsb0" in text:
            return _State(state.in_flight + (group,), None)
        return _State(state.in_flight, group)
    d = _DEPBAR.match(text)
    if d:
        keep = int(d.group(1), 0)
        return _State(state.in_flight[len(state.in_flight) - keep:] if keep else (), state.open_group)
    written = set(written_registers(text))
    if written:
        groups = list(state.in_flight) + ([state.open_group] if state.open_group else [])
        for start, regs in groups:
            hit = written & regs
            if hit:
                hazards.setdefault((ins.address, start), Hazard(ins, start, tuple(sorted(hit))))
    return state


def find_hazards(sass: str) -> list[Hazard]:
    """Every write to a register an in-flight register-A wgmma still reads, over all paths."""
    return _hazards(*parse(sass))


def _hazards(code: list[Instruction], labels: dict[str, int]) -> list[Hazard]:
    hazards: dict = {}
    seen: set[tuple[int, _State]] = set()
    work = [(0, _State())]
    while work:
        pc, state = work.pop()
        while pc < len(code) and (pc, state) not in seen:
            seen.add((pc, state))
            ins = code[pc]
            state = _step(ins, state, hazards)
            opcode = ins.text.split(" ")[0]
            if opcode.startswith(("BRA", "WARPSYNC.COLLECTIVE")) and _TARGET.search(ins.text):
                target = labels.get(_TARGET.search(ins.text).group(1))
                if target is not None:
                    work.append((target, state))
                if not ins.guarded and not opcode.startswith(("BRA.DIV", "WARPSYNC")):
                    break
            elif opcode in ("EXIT", "RET", "RET.REL", "RET.ABS") and not ins.guarded:
                break
            pc += 1
    return sorted(hazards.values(), key=lambda h: h.write.address)


def cubin_sass(cubin: bytes) -> str:
    """The cubin's SASS, by Triton's bundled nvdisasm (it works without a GPU)."""
    return run_on_cubin("nvdisasm", "-c", "-ndf", cubin=cubin)  # (no dataflow pass: the same text, sooner)


def check_cubin(cubin: bytes) -> tuple[list[Hazard], int]:
    """The cubin's hazards, and how many wgmma instructions it issues (where a hazard can arise)."""
    code, labels = parse(cubin_sass(cubin))
    return _hazards(code, labels), sum(ins.text.startswith("HGMMA") for ins in code)
