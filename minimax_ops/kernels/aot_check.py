"""Compile every Triton kernel ahead of time for every target in aot.TARGETS, without a GPU.

    python -m minimax_ops.kernels.aot_check                 # all kernel modules, all targets
    python -m minimax_ops.kernels.aot_check norm moe        # only these modules
    python -m minimax_ops.kernels.aot_check --list          # what would be compiled, and coverage
    python -m minimax_ops.kernels.aot_check --target gfx942 --kernel rmsnorm -j 2 --json out.json
    python -m minimax_ops.kernels.aot_check --target cuda --every-spec   # every spec's registers, not a cover

Each kernel module lists its specialisations in ``aot_specs() -> list[KernelSpec]``; those compiled are
run through the real compiler (``triton.compile(ASTSource(...), target=GPUTarget(...))``) down to
a cubin (CUDA) or hsaco (HIP); each cubin is disassembled and refused if it writes a register an
in-flight wgmma still reads (``wgmma_hazards``). Each target compiles a cover of each kernel's specs
(``aot.cover``), and on CUDA every spec of a kernel whose compiles issue wgmma (``aot.EVERY_SPEC_IF_WGMMA``).
The Triton interpreter replaces ``@triton.jit`` functions, so this must run with TRITON_INTERPRET unset (it
re-executes itself without it).

Coverage: every ``@triton.jit`` function defined in a kernel module must be listed in some spec or
be called (directly or transitively) by a listed kernel; anything else is UNCOVERED and fails the
check. After compiling, helpers that no compile actually generated (read from the initial IR: they
sit behind constexpr branches no spec takes, e.g. interpreter-only code) are listed as NOTEs.
Prints one line per (spec, target), CUDA ones with what a program holds (registers, stack, shared memory) and
how many an SM keeps resident (cubin_resources), and exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import ast
import collections
import concurrent.futures as futures
import importlib
import json
import multiprocessing
import os
import pkgutil
import re
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from types import ModuleType

from . import cubin_resources, wgmma_hazards
from .aot import COVER_FROM_END, EVERY_SPEC_IF_WGMMA, TARGETS, cover

PACKAGE = "minimax_ops.kernels"
NOT_KERNEL_MODULES = {"aot", "aot_check", "cubin_resources", "wgmma_hazards"}


@dataclass
class Result:
    module: str
    name: str  # the spec's label
    kernel: str  # the @triton.jit function's name
    target: str  # "cuda:90", "hip:gfx942", ...
    ok: bool
    error: str = ""
    seconds: float = 0.0
    functions: list[str] = field(default_factory=list)  # symbols in the initial IR (kernel + helpers)
    resources: str = ""  # CUDA: a program's registers, stack and shared memory (cubin_resources)
    wgmma: int = 0  # CUDA: wgmma instructions in the cubin


# ---- discovery --------------------------------------------------------------------------------------------


def module_names() -> list[str]:
    package = importlib.import_module(PACKAGE)
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name not in NOT_KERNEL_MODULES)


def select_modules(filters: list[str]) -> list[str]:
    names = module_names()
    if not filters:
        return names
    wanted = [f.rsplit(".", 1)[-1].removesuffix(".py") for f in filters]
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise SystemExit(f"unknown kernel module(s) {unknown}; expected some of {names}")
    return [n for n in names if n in wanted]


def _jit_type():
    from triton.runtime.jit import JITFunction
    return JITFunction


def unwrap(obj):
    """The JITFunction under @triton.autotune / @triton.heuristics wrappers (None if there is none)."""
    jit = _jit_type()
    for _ in range(8):
        if isinstance(obj, jit):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def jit_functions(module: ModuleType) -> dict[str, object]:
    """@triton.jit functions defined in (not imported into) a module, by name."""
    out = {}
    for name, value in vars(module).items():
        fn = unwrap(value)
        if fn is not None and getattr(fn, "__module__", None) == module.__name__:
            out[name] = fn
    return out


def callees(fn) -> list[object]:
    """@triton.jit functions that fn's body calls (plain names and module attributes)."""
    scope = fn.get_capture_scope()
    found = []
    for node in ast.walk(fn.parse()):
        if not isinstance(node, ast.Call):
            continue
        target, path = node.func, []
        while isinstance(target, ast.Attribute):
            path.append(target.attr)
            target = target.value
        if not isinstance(target, ast.Name) or target.id not in scope:
            continue
        value = scope[target.id]
        for attr in reversed(path):
            value = getattr(value, attr, None)
        callee = unwrap(value)
        if callee is not None:
            found.append(callee)
    return found


def kernel_name(spec) -> str:
    """The name of the function a spec compiles (under @triton.autotune / @triton.heuristics wrappers)."""
    return getattr(unwrap(spec.kernel) or spec.kernel, "__name__", "?")


def reachable(kernels) -> set[int]:
    """ids of the given kernels and every @triton.jit function they call, transitively."""
    seen, stack = set(), list(kernels)
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        stack.extend(callees(fn))
    return seen


@dataclass
class ModuleSpecs:
    name: str
    specs: list  # list[KernelSpec]
    jit: dict  # name -> JITFunction defined in the module
    error: str = ""  # import or aot_specs() failure
    module: str = ""  # import name, when not f"{PACKAGE}.{name}"

    @property
    def import_name(self) -> str:
        return self.module or f"{PACKAGE}.{self.name}"


def load(name: str) -> ModuleSpecs:
    try:
        module = importlib.import_module(f"{PACKAGE}.{name}")
    except Exception as e:  # a module that does not import is a failure to report, not a crash
        return ModuleSpecs(name, [], {}, f"import failed: {type(e).__name__}: {e}")
    jit = jit_functions(module)
    if not hasattr(module, "aot_specs"):
        return ModuleSpecs(name, [], jit, "defines @triton.jit kernels but no aot_specs()" if jit else "")
    try:
        specs = list(module.aot_specs())
    except Exception as e:
        return ModuleSpecs(name, [], jit, f"aot_specs() raised {type(e).__name__}: {e}")
    return ModuleSpecs(name, specs, jit)


def uncovered(loaded: list[ModuleSpecs]) -> list[str]:
    """Source estimate: 'module.function' for every @triton.jit function that is neither listed in a
    spec nor called, directly or transitively, by a listed kernel."""
    listed = [unwrap(s.kernel) for m in loaded for s in m.specs]
    covered = reachable([k for k in listed if k is not None])
    return [f"{m.name}.{name}" for m in loaded for name, fn in m.jit.items() if id(fn) not in covered]


def not_compiled(loaded: list[ModuleSpecs], results: list[Result]) -> list[str]:
    """'module.function' for every @triton.jit function that no successful compile generated code for.
    Helpers appear in the IR as '<module>.<name>__<specialisation>', kernels by their bare name."""
    by_name = {m.name: m for m in loaded}
    done = set()
    for r in results:
        if r.ok and r.module in by_name:
            done.add(f"{by_name[r.module].import_name}.{r.kernel}")
            done.update(r.functions)
    return [f"{m.name}.{name}" for m in loaded for name in m.jit
            if not any(d == f"{m.import_name}.{name}" or d.startswith(f"{m.import_name}.{name}__") for d in done)]


# ---- compilation ------------------------------------------------------------------------------------------


def target_label(target: tuple) -> str:
    return f"{target[0]}:{target[1]}"


def spec_wants(spec, target: tuple) -> bool:
    """A spec may name its targets (``targets = ("cuda",)`` for a CUDA-only PTX path); default: all."""
    wanted = getattr(spec, "targets", None)
    return not wanted or any(w in target_label(target) for w in wanted)


def compiled_on(specs: list, target: tuple, every: bool = False) -> list[int]:
    """Indices of the specs first compiled for target: the aot.cover of those that want it (taken from the
    list's end on aot.COVER_FROM_END), or with ``every`` all of them. ``more_specs`` adds the rest of a kernel's
    where its compiles issue wgmma."""
    wanted = [i for i, s in enumerate(specs) if spec_wants(s, target)]
    if every:
        return wanted
    return [wanted[j] for j in cover([specs[i] for i in wanted], from_end=target_label(target) in COVER_FROM_END)]


def more_specs(specs: list, result: Result, target: tuple, given: set[int]) -> list[int]:
    """After ``result`` (a compile of one of ``specs`` for ``target``): if it issued wgmma on a target in
    aot.EVERY_SPEC_IF_WGMMA, the indices of its kernel's other specs that want the target and are not in
    ``given`` (the indices compiled or queued for it so far), else none."""
    if not (result.ok and result.wgmma and target_label(target) in EVERY_SPEC_IF_WGMMA):
        return []
    return [i for i, s in enumerate(specs) if i not in given and spec_wants(s, target)
            and kernel_name(s) == result.kernel]


def full_signature(spec) -> dict[str, str]:
    """Triton's ASTSource wants every parameter in the signature, constexprs typed "constexpr"."""
    kernel = unwrap(spec.kernel)
    if kernel is None:
        raise TypeError(f"kernel: expected a @triton.jit function, got {type(spec.kernel).__name__}")
    constexprs = constexpr_values(spec)
    names = [p.name for p in kernel.params]
    missing = [n for n in names if n not in spec.signature and n not in constexprs]
    unknown = [n for n in list(spec.signature) + list(spec.constexprs) if n not in names]
    wrong = [n for n, ty in spec.signature.items() if n in names and kernel.params[names.index(n)].is_constexpr
             and n not in constexprs and ty != "constexpr"]
    if missing or unknown or wrong:
        raise TypeError(f"spec {spec.label()!r} does not match {kernel.__name__}{tuple(names)}: "
                        f"missing {missing}, unknown {unknown}, constexpr without a value {wrong}")
    return {n: "constexpr" if n in constexprs else spec.signature[n] for n in names}


def constexpr_values(spec) -> dict[str, object]:
    """The spec's constexprs plus the defaults of the parameters it leaves out (a launch that leaves out
    a defaulted argument passes its default: None pointers of a form the flags turn off, say)."""
    import inspect
    kernel = unwrap(spec.kernel)
    values = {}
    for p in kernel.params:
        if (p.name not in spec.constexprs and p.name not in spec.signature
                and p.default is not inspect.Parameter.empty):
            values[p.name] = p.default
    values.update(spec.constexprs)
    return values


def launch_divisibility(signature: dict[str, str], sixteen: tuple[str, ...] = ()) -> dict:
    """Triton's divisibility attributes as a CUDA launch specialises them: 16-byte aligned pointers, strides
    multiples of 16, and the integer arguments in ``sixteen`` that the launches guarantee are too."""
    return {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
            if kind.startswith("*") or (kind != "constexpr" and (name.startswith("stride") or name in sixteen))}


_IR_FUNC = re.compile(r"tt\.func\s+(?:public\s+|private\s+)?@([\w.]+)")


def compile_as_launched(spec, target: tuple, sixteen: tuple[str, ...] = ()):
    """triton.compile of the spec for target, specialised as a launch is (CUDA: ``launch_divisibility`` with
    ``sixteen``, and the spec's register cap); the compiled kernel, its ``asm`` by stage."""
    import triton
    from triton.backends.compiler import GPUTarget
    signature = full_signature(spec)
    attrs = launch_divisibility(signature, sixteen) if target[0] == "cuda" else None
    src = triton.compiler.ASTSource(fn=unwrap(spec.kernel), signature=signature, constexprs=constexpr_values(spec),
                                    attrs=attrs)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    if spec.max_registers and target[0] == "cuda":
        options["maxnreg"] = spec.max_registers
    return triton.compile(src, target=GPUTarget(*target), options=options)


def compile_spec(spec, target: tuple) -> tuple[list[str], cubin_resources.Resources | None, int]:
    """Compile down to the target's binary; returns the function symbols of the initial IR and, for CUDA, what
    one program holds (cubin_resources) and how many wgmma instructions it issues."""
    compiled = compile_as_launched(spec, target)
    binary = "cubin" if target[0] == "cuda" else "hsaco"
    if not compiled.asm.get(binary):
        raise RuntimeError(f"compiled without producing a {binary}")
    capped = spec.max_registers and target[0] == "cuda"
    if capped and f".maxnreg {spec.max_registers}" not in str(compiled.asm.get("ptx", "")):
        raise RuntimeError(f"the register cap {spec.max_registers} did not reach the PTX")
    resources, wgmma = None, 0
    if target[0] == "cuda":
        hazards, wgmma = wgmma_hazards.check_cubin(compiled.asm["cubin"])
        if hazards:
            raise RuntimeError(f"wgmma register race: {len(hazards)} writes to in-flight A registers, first "
                               f"{hazards[0]}")
        resources = cubin_resources.cubin_resources(compiled.asm["cubin"], compiled.metadata.name,
                                                    compiled.metadata.shared, spec.num_warps)
    return _IR_FUNC.findall(str(compiled.asm.get("source") or compiled.asm.get("ttir") or "")), resources, wgmma


class CapturedStderr:
    """Collects what native code (LLVM, lld, ptxas) writes to fd 2 while compiling: on HIP the
    assembler's reason for a failure goes there and the Python exception only says "link failed"."""

    def __enter__(self):
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile(mode="w+b")
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        self.text = self.file.read().decode(errors="replace").strip()
        self.file.close()
        return False


_LOADED: dict[str, ModuleSpecs] = {}


def run_one(module: str, index: int, target: tuple) -> Result:
    """Compile spec `index` of `module` for `target` (in a worker process or in-process)."""
    if module not in _LOADED:
        _LOADED[module] = load(module)
    spec = _LOADED[module].specs[index]
    result = Result(module, spec.label(), kernel_name(spec), target_label(target), False)
    start = time.perf_counter()
    captured = CapturedStderr()
    try:
        with captured:
            result.functions, resources, result.wgmma = compile_spec(spec, target)
        result.ok = True
        result.resources = str(resources or "")
    except Exception as e:
        text = "".join(traceback.format_exception_only(type(e), e)).strip() or type(e).__name__
        native = getattr(captured, "text", "")
        result.error = f"{native}\n{text}" if native else text
    result.seconds = time.perf_counter() - start
    return result


def one_line(error: str) -> str:
    """The most telling line: an LLVM/assembler 'error:' if there is one, else the last line
    (Triton's CompilationError puts the source excerpt first and the reason last)."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    native = [ln for ln in lines if ln.startswith("error:") or ": error:" in ln]
    if native:
        return native[0][:240]
    return lines[-1][:240] if lines else ""


def specs_per_kernel(loaded: list[ModuleSpecs], targets: list[tuple]) -> list[tuple[str, str, str, int]]:
    """(module, kernel, target, how many of the kernel's specs want the target), for the JSON report."""
    count = collections.Counter((m.name, kernel_name(s), target_label(t)) for m in loaded for s in m.specs
                                for t in targets if spec_wants(s, t))
    return [(*key, n) for key, n in sorted(count.items())]


def compile_all(tasks: list[tuple], jobs: int, follow_ups):
    """Results of the (module, spec index, target) tasks, as they finish, and of the tasks
    ``follow_ups(result, task)`` adds for each, on ``jobs`` processes."""
    if jobs == 1:
        queue = collections.deque(tasks)
        while queue:
            task = queue.popleft()
            result = run_one(*task)
            queue.extend(follow_ups(result, task))
            yield result
        return
    # spawn: fresh interpreters with this environment (no interpreter, private cache); the importable
    # module's run_one (this file may be running as __main__)
    worker = importlib.import_module(f"{PACKAGE}.aot_check").run_one
    with futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        pending = {pool.submit(worker, *task): task for task in tasks}
        while pending:
            done, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
            for future in done:
                task = pending.pop(future)
                result = future.result()
                pending.update({pool.submit(worker, *more): more for more in follow_ups(result, task)})
                yield result


# ---- command line -----------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m minimax_ops.kernels.aot_check", description=__doc__.split("\n")[0])
    p.add_argument("modules", nargs="*", help="kernel modules to check (default: all), e.g. norm moe")
    p.add_argument("--list", action="store_true", help="list specs and coverage, compile nothing")
    p.add_argument("--target", action="append", default=[], help="only targets containing this (e.g. gfx942, cuda)")
    p.add_argument("--kernel", default="", help="only specs whose label or kernel name contains this")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiler processes")
    p.add_argument("--json", metavar="PATH", help="also write results and coverage as JSON")
    p.add_argument("--every-spec", action="store_true",
                   help="compile every spec for every target (default: each target a cover, see aot.cover)")
    p.add_argument("--keep-cache", action="store_true",
                   help="use the normal Triton cache (default: a fresh temporary one, so everything really compiles)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # The interpreter swaps @triton.jit for interpreted functions; start over without it.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        print("aot_check: TRITON_INTERPRET is set; re-running without it", flush=True)
        os.execve(sys.executable, [sys.executable, "-m", "minimax_ops.kernels.aot_check", *argv], env)
    args = parse_args(argv)

    names = select_modules(args.modules)
    loaded = [load(n) for n in names]
    _LOADED.update({m.name: m for m in loaded})
    targets = [t for t in TARGETS if not args.target or any(f in target_label(t) for f in args.target)]
    if not targets:
        raise SystemExit(f"--target {args.target} matches none of {[target_label(t) for t in TARGETS]}")
    def selected(spec) -> bool:
        return (not args.kernel or args.kernel in spec.label()
                or args.kernel in kernel_name(spec))

    tasks = []  # (module, spec index, target), by module, spec, target
    for m in loaded:
        on = {t: set(compiled_on(m.specs, t, every=args.every_spec)) for t in targets}
        tasks += [(m.name, i, t) for i, s in enumerate(m.specs) if selected(s) for t in targets if i in on[t]]
    given: dict[tuple, set[int]] = {}  # (module, target) -> the spec indices compiled or queued for it
    for name, i, t in tasks:
        given.setdefault((name, t), set()).add(i)

    def follow_ups(result: Result, task: tuple) -> list[tuple]:
        name, _, target = task
        specs = _LOADED[name].specs
        more = [i for i in more_specs(specs, result, target, given[(name, target)]) if selected(specs[i])]
        given[(name, target)].update(more)
        return [(name, i, target) for i in more]
    broken = [m for m in loaded if m.error]
    missing = uncovered(loaded)

    for m in loaded:
        jit_names = ", ".join(m.jit) or "-"
        print(f"module {m.name}: {len(m.specs)} specs; @triton.jit: {jit_names}" + (f"  [{m.error}]" if m.error else ""))
    if args.list:
        for name, i in dict.fromkeys((name, i) for name, i, _ in tasks):
            s = _LOADED[name].specs[i]
            only = [target_label(t) for n, j, t in tasks if (n, j) == (name, i)]
            print(f"  {name}.{s.label()}  kernel={kernel_name(s)}  "
                  f"num_warps={s.num_warps} num_stages={s.num_stages} constexprs={s.constexprs}"
                  + ("" if len(only) == len(targets) else f"  targets={only}"))
        print(f"{len({(n, i) for n, i, _ in tasks})} specs, {len(tasks)} compiles over {len(targets)} targets"
              + ("" if args.every_spec else f"; on {', '.join(EVERY_SPEC_IF_WGMMA)} every other spec of a kernel "
                 "whose compiles issue wgmma follows"))
    for u in missing:
        print(f"UNCOVERED {u}: not in any aot_specs() and not called by a listed kernel")
    if args.list:
        return 1 if missing or broken else 0

    if not args.keep_cache:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="minimax_aot_")
    results: list[Result] = []
    start = time.perf_counter()
    for r in compile_all(tasks, max(1, min(args.jobs, len(tasks))), follow_ups):
        results.append(r)
        status = (f"ok {r.resources}" if r.resources else "ok") if r.ok else f"FAILED {one_line(r.error)}"
        wgmma = f" wgmma {r.wgmma}" if r.wgmma else ""
        print(f"{r.target:<11} {r.module}.{r.name} ({r.kernel}) {r.seconds:5.1f}s {status}{wgmma}", flush=True)

    failed = [r for r in results if not r.ok]
    # With --kernel only some specs ran, so "never generated" would say nothing.
    unused = [] if args.kernel else [n for n in not_compiled(loaded, results) if n not in missing]
    for u in unused:
        print(f"NOTE {u}: called in the source, but no successful compile generated it "
              "(behind constexpr branches no spec takes, or its kernel failed)")
    for r in failed:
        print(f"\n---- {r.target} {r.module}.{r.name}\n{r.error[-3000:]}")
    for m in broken:
        print(f"FAILED module {m.name}: {m.error}")
    per_target = {target_label(t): sum(r.ok for r in results if r.target == target_label(t)) for t in targets}
    print(f"\n{len(results) - len(failed)}/{len(results)} compiled in {time.perf_counter() - start:.1f}s; "
          f"ok per target: {per_target}; {len(missing)} uncovered; {len(broken)} broken modules")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": [asdict(r) for r in results], "uncovered": missing, "never_generated": unused,
                       "broken": {m.name: m.error for m in broken}, "targets": [target_label(t) for t in targets],
                       "modules": {m.name: sorted(m.jit) for m in loaded},
                       "specs": specs_per_kernel(loaded, targets)}, f, indent=1)
    return 1 if failed or missing or broken else 0


if __name__ == "__main__":
    sys.exit(main())
