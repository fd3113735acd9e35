"""The GPU builds of trimpass's Triton kernels, checked without a GPU: every kernel of
``trimpass.kernels`` (the trimmed head and the admission kernel), every config the autotuner can
pick, in every dtype the ops accept, is compiled ahead of time for sm_80 and sm_90 with the
specialization the JIT would apply at launch (triton's own binder run on the launcher's arguments,
meta tensors of the real shapes: 16-byte-aligned pointers and integers divisible by 16 marked
divisible, integers equal to 1 made constants), then read back: registers, stack (spill) bytes and
shared memory from the wheel's ``cuobjdump -res-usage``, and the width of each load of the weight
from the LLVM IR, where each load still names its source line (the SASS count of 16-byte loads is
printed beside it). A build fails the check on more than :data:`MAX_STACK` bytes of stack, more
than :data:`MAX_REGS_SMALL_M` registers for a head config that serves ``M <= 16``, a weight load
narrower than 16 bytes, or when it no longer builds; the default and ``--ci`` selections also fail
when a config of the head is never built. ``python -m trimpass.testing.gpu_build --help`` (with
``TRITON_INTERPRET`` unset) lists the options; it prints the table, writes it as markdown with
``--out`` and exits 1 on any failure, 2 when it cannot run.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import triton

ARCHS = (80, 90)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
HEADS = {"gemma3-270m": (262_144, 640), "llama3-8b-eagle": (128_256, 4_096)}  # (V, d)
CAPACITY = 4096  # the dynamic vocabulary's default capacity: idx[G, CAP]
ROWS = (1, 64)  # M: a decode step, a 64-token verification or tree
MODES = ("compact", "scatter")
ADMIT_IDS = (1, 32, 64)  # ids per row per admission call: BLOCK_S 16, 32 and 64
MAX_STACK = 16
MAX_REGS_SMALL_M = 128
SMALL_M = 16
WEIGHT_LOAD = "tl.load(w_rows"  # how the head kernel's source loads the weight
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TOOLS = ("ptxas", "cuobjdump")
CI = dict(archs=ARCHS, dtypes=("bf16", "fp32"), heads=("gemma3-270m",), rows=ROWS,
          modes=("compact",), admit_ids=(64,))


def missing_tools() -> list[str]:
    """The tools this check needs that the installed triton wheel does not ship."""
    return [t for t in TOOLS if not os.access(os.path.join(BIN, t), os.X_OK)]


@dataclass
class Build:
    kernel: str
    arch: int
    dtype: str
    shape: str
    rows: int
    config: str
    regs: int = -1
    stack: int = -1
    shared: int = -1
    wide_loads: int = 0  # weight loads 16 bytes wide
    weight_loads: int = 0  # all weight loads
    sass_wide: int = 0  # 16-byte global loads in the SASS, weight or not
    has_weight: bool = True
    seconds: float = 0.0
    error: str = ""

    def problems(self) -> list[str]:
        if self.error:
            return [f"does not build: {self.error}"]
        out = []
        if self.stack > MAX_STACK:
            out.append(f"stack {self.stack} bytes > {MAX_STACK} (registers spill)")
        if self.kernel == "head" and self.rows <= SMALL_M and self.regs > MAX_REGS_SMALL_M:
            out.append(f"{self.regs} registers > {MAX_REGS_SMALL_M} for M <= {SMALL_M}")
        if self.has_weight and not self.weight_loads:
            out.append("no weight load found in the SASS")
        elif self.wide_loads < self.weight_loads:
            out.append(f"{self.weight_loads - self.wide_loads} of {self.weight_loads} weight "
                       "loads narrower than 16 bytes")
        return out

    def row(self) -> str:
        loads = f"{self.wide_loads}/{self.weight_loads}" if self.has_weight else "-"
        status = "; ".join(self.problems()) or "ok"
        return (f"| {self.kernel} | sm_{self.arch} | {self.dtype} | {self.shape} | {self.rows} | "
                f"{self.config} | {self.regs} | {self.stack} | {self.shared} | {loads} | "
                f"{self.sass_wide} | {self.seconds:.1f} | {status} |")


HEADER = ("| kernel | arch | dtype | shape | M | config | registers | stack B | shared B | "
          "16-byte weight loads | SASS 128-bit loads | build s | status |\n"
          + "|---" * 13 + "|")


def jit_function(fn):
    """The kernel as a ``JITFunction``: under ``TRITON_INTERPRET=1`` triton hands out interpreted
    functions, which wrap the same Python function."""
    from triton.runtime.jit import JITFunction
    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)


_binders: dict = {}


def specialize(fn, arch: int, args: tuple, kwargs: dict):
    """What the JIT would compile for these launch arguments on ``sm_<arch>``: target, signature,
    constexprs, attrs and options, from triton's own binder (``create_function_from_signature``)
    and ``JITFunction._pack_args``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget("cuda", arch, 32)
    if (fn, arch) not in _binders:
        backend = make_backend(target)
        _binders[fn, arch] = backend, create_function_from_signature(fn.signature, fn.params,
                                                                      backend)
    backend, binder = _binders[fn, arch]
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    return target, signature, constexprs, attrs, options


def compile_asm(fn, arch: int, args: tuple, kwargs: dict) -> dict:
    """Build for ``sm_<arch>``; the compiler's stages by name (``llir``, ``ptx``, ``cubin`` ...)."""
    from triton.compiler import ASTSource
    target, signature, constexprs, attrs, options = specialize(fn, arch, args, kwargs)
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__).asm


def _tool(name: str, cubin: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(BIN, name), *flags, f.name], check=True,
                              capture_output=True, text=True).stdout


def parse_resources(text: str) -> dict[str, int]:
    """``REG``, ``STACK``, ``SHARED`` and ``LOCAL`` of the one function ``cuobjdump -res-usage``
    printed."""
    found = re.findall(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if len(found) != 1:
        raise ValueError(f"expected one function's resource usage, found {len(found)}")
    return dict(zip(("regs", "stack", "shared", "local"), map(int, found[0]), strict=True))


def parse_loads(llir: str, lines: set[int]) -> list[int]:
    """Bytes per thread of each global load (``ld.global``, ``cp.async``) in Triton's LLVM IR whose
    debug location is one of ``lines``. Triton emits loads as inline PTX, which LLVM and ptxas keep
    whole (``ld.global.v4.b32`` is ``LDG.E.128`` in SASS), so the width read here is the SASS one;
    the LLVM IR, unlike the PTX and SASS line tables, still names the source line of each load."""
    where = {m.group(1): int(m.group(2))
             for m in re.finditer(r"^(!\d+) = !DILocation\(line: (\d+)", llir, re.MULTILINE)}
    widths = []
    for text in llir.splitlines():
        dbg = re.search(r"!dbg (!\d+)\s*$", text)
        if not dbg or where.get(dbg.group(1)) not in lines:
            continue
        if m := re.search(r"cp\.async\.\w+\.shared\.global[^,]*,[^,]*,\s*(0x[0-9a-f]+|\d+)", text):
            widths.append(int(m.group(1), 0))
        elif m := re.search(r"ld\.global((?:\.[\w:]+)+)", text):
            parts = m.group(1).split(".")
            lanes = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
            widths.append(lanes * int(re.search(r"\d+$", parts[-1]).group()) // 8)
    return widths


def sass_wide_loads(sass: str) -> int:
    """The 16-byte global loads (``LDG.E.128``, ``LDGSTS.E.BYPASS.128`` ...) of a SASS listing."""
    return sum("128" in op.split(".")[1:] for op in re.findall(r"\bLDG(?:STS)?(?:\.\w+)+", sass))


def source_lines(fn, needle: str) -> set[int]:
    """The lines of ``fn``'s file containing ``needle``."""
    with open(fn.fn.__code__.co_filename) as f:
        return {i for i, line in enumerate(f, 1) if needle in line}


def inspect_build(b: Build, fn, args: tuple, kwargs: dict, needle: str | None) -> Build:
    t0 = time.perf_counter()
    try:
        asm = compile_asm(fn, b.arch, args, kwargs)
    except Exception as e:  # noqa: BLE001 - any failure to build is the finding
        b.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
        b.seconds = time.perf_counter() - t0
        return b
    b.seconds = time.perf_counter() - t0
    res = parse_resources(_tool("cuobjdump", asm["cubin"], "-res-usage"))
    b.regs, b.stack, b.shared = res["regs"], res["stack"] + res["local"], res["shared"]
    b.sass_wide = sass_wide_loads(_tool("cuobjdump", asm["cubin"], "--dump-sass"))
    b.has_weight = needle is not None
    if needle:
        widths = parse_loads(asm["llir"], source_lines(fn, needle))
        b.weight_loads, b.wide_loads = len(widths), sum(w == 16 for w in widths)
    return b


def config_name(c: triton.Config) -> str:
    k = c.kwargs
    return f"m{k['BLOCK_M']} k{k['BLOCK_K']} d{k['BLOCK_D']} w{c.num_warps} s{c.num_stages}"


def head_builds(archs, dtypes, heads, rows, modes, planted=()):
    """Every (arch, dtype, head, M, mode) x every config the autotuner keeps for that M, plus the
    ``planted`` configs at every M."""
    from trimpass.kernels import trimmed_head as th
    fn = jit_function(th.KERNEL)
    for arch in archs:
        for dt in dtypes:
            for head in heads:
                V, d = HEADS[head]
                for R in rows:
                    x = torch.empty(1, R, d, device="meta", dtype=DTYPES[dt])
                    w = torch.empty(V, d, device="meta", dtype=DTYPES[dt])
                    idx = torch.empty(1, CAPACITY, device="meta", dtype=torch.int64)
                    count = torch.empty(1, device="meta", dtype=torch.int32)
                    for mode in modes:
                        scatter = mode == "scatter"
                        out = torch.empty(1, R, V if scatter else CAPACITY, device="meta",
                                          dtype=DTYPES[dt])
                        args, flags = th.launch_args(x, w, idx, count, None, 1.0, 0.0, out,
                                                     scatter, True)
                        named = dict(zip(fn.arg_names, args, strict=False))  # flags after args
                        configs = th.prune_configs(th.CONFIGS, named)
                        for c in [*configs, *planted]:
                            b = Build("head", arch, dt, f"{head} {mode}", R, config_name(c))
                            yield b, fn, args, {**flags, **c.all_kwargs()}, WEIGHT_LOAD


def admit_builds(archs, ids_per_row):
    """The admission kernel at the default capacity, one batch position, each block of ids."""
    from trimpass.kernels import vocab_state as vs
    fn = jit_function(vs.KERNEL)
    idx = torch.empty(1, CAPACITY + vs.SCRATCH, device="meta", dtype=torch.int64)
    i32 = dict(device="meta", dtype=torch.int32)
    i64 = dict(device="meta", dtype=torch.int64)
    for arch in archs:
        for S in ids_per_row:
            args, blocks = vs.launch_args(idx, torch.empty_like(idx), torch.empty(1, **i32),
                                          torch.empty(1, **i64), torch.empty(1, **i64),
                                          torch.empty(1, S, **i64),
                                          torch.empty(1, CAPACITY, **i64), 0)
            name = " ".join(f"{k}={v}" for k, v in blocks.items())
            b = Build("admit", arch, "int64", f"cap {CAPACITY}, {S} ids", 1, name)
            yield b, fn, args, blocks, None


def run(archs, dtypes, heads, rows, modes, admit_ids, planted=(), echo=print) -> list[Build]:
    builds = []
    for b, fn, args, kwargs, needle in [*head_builds(archs, dtypes, heads, rows, modes, planted),
                                        *admit_builds(archs, admit_ids)]:
        builds.append(inspect_build(b, fn, args, kwargs, needle))
        echo(builds[-1].row())
    return builds


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()}, Python {platform.python_version()}"


def commit() -> str:
    """HEAD's short hash, marked when kernels/ has changes not committed."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "kernels"]).returncode
        return head + (" with uncommitted changes to kernels/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def unbuilt_configs(builds: list[Build]) -> list[str]:
    """The head's configs (``CONFIGS``) that no build of ``builds`` used."""
    from trimpass.kernels.trimmed_head import CONFIGS
    built = {b.config for b in builds if b.kernel == "head"}
    return [name for name in map(config_name, CONFIGS) if name not in built]


def report(builds: list[Build], command: str, seconds: float, unbuilt: list[str]) -> str:
    bad = [b for b in builds if b.problems()]
    lines = [
        "# GPU builds of the Triton kernels: registers, spills, load widths",
        "",
        f"Command: `{command}` (commit {commit()}, triton {triton.__version__}, torch "
        f"{torch.__version__}; {machine()}; no GPU: ahead-of-time builds). {len(builds)} builds "
        f"in {seconds:.0f} s. Each build carries the JIT's launch specialization for the shape "
        f"(meta tensors, capacity {CAPACITY}, one id group). \"16-byte weight loads\": loads of "
        "the weight 16 bytes wide per thread, of all loads of the weight (from the LLVM IR); "
        "\"SASS 128-bit loads\": all LDG / LDGSTS .128 instructions of the build. Limits: stack "
        f"<= {MAX_STACK} B; <= {MAX_REGS_SMALL_M} registers where M <= {SMALL_M}; every weight "
        "load 16 bytes.",
        "",
        HEADER,
        *(b.row() for b in builds),
        "",
        f"{len(builds)} builds, {len(bad)} failing the check; head configs never built: "
        f"{', '.join(unbuilt) or 'none'}.",
    ]
    return "\n".join(lines) + "\n"


def _planted(text: str) -> triton.Config:
    bm, bk, bd, w, s = (int(v) for v in text.split(","))
    return triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_D": bd}, num_warps=w, num_stages=s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trimpass.testing.gpu_build",
                                description=__doc__.split("\n\n")[0].replace("\n", " "),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), help="sm_XX targets")
    p.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--head", nargs="+", default=list(HEADS), choices=list(HEADS))
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="M, rows per launch")
    p.add_argument("--mode", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--admit-ids", type=int, nargs="*", default=list(ADMIT_IDS),
                   help="ids per row of the admission kernel builds")
    p.add_argument("--ci", action="store_true", help=f"the CI subset: {CI}")
    p.add_argument("--plant", type=_planted, action="append", default=[],
                   metavar="BM,BK,BD,WARPS,STAGES", help="also build this head config at every M")
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--cache", default=None,
                   help="triton cache directory (default: a fresh one, so every build is timed)")
    a = p.parse_args(argv)
    if missing := missing_tools():
        print(f"gpu_build: the triton wheel at {BIN} lacks {', '.join(missing)}", file=sys.stderr)
        return 2
    if triton.knobs.runtime.interpret:
        print("gpu_build: unset TRITON_INTERPRET (the interpreter replaces the compiler)",
              file=sys.stderr)
        return 2
    full = dict(archs=a.arch, dtypes=a.dtype, heads=a.head, rows=a.rows, modes=a.mode,
                admit_ids=a.admit_ids)
    sel = dict(CI) if a.ci else full
    coverage = a.ci or full == dict(archs=list(ARCHS), dtypes=list(DTYPES), heads=list(HEADS),
                                    rows=list(ROWS), modes=list(MODES), admit_ids=list(ADMIT_IDS))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRITON_CACHE_DIR"] = a.cache or tmp
        print(HEADER)
        t0 = time.perf_counter()
        builds = run(**sel, planted=a.plant)
        seconds = time.perf_counter() - t0
    unbuilt = unbuilt_configs(builds)
    command = "python -m trimpass.testing.gpu_build " + shlex.join(sys.argv[1:] if argv is None
                                                                   else argv)
    text = report(builds, command.strip(), seconds, unbuilt)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    bad = [b for b in builds if b.problems()]
    for b in bad:
        print(f"FAILED {b.kernel} sm_{b.arch} {b.dtype} {b.shape} M={b.rows} {b.config}: "
              + "; ".join(b.problems()))
    if coverage and unbuilt:
        print(f"FAILED head configs never built: {', '.join(unbuilt)} (no M or dtype built "
              "keeps them: prune_configs drops them everywhere, or ROWS misses their M)")
    print(text.strip().splitlines()[-1])
    return 1 if bad or coverage and unbuilt else 0


if __name__ == "__main__":
    sys.exit(main())
