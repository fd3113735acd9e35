"""The GPU builds of the kernels, checked on a machine without a GPU
(``trimpass.testing.gpu_build``): the CI subset builds clean for sm_80 and sm_90, a planted
spilling config fails the check, the builds carry the JIT's launch specialization, and the parsers
read what the tools print. The builds run in a subprocess without TRITON_INTERPRET (the
interpreter replaces the compiler); they are skipped, saying so, where the installed triton wheel
lacks ptxas or cuobjdump."""
import os
import subprocess
import sys

import pytest
import torch

from trimpass.testing import gpu_build

needs_tools = pytest.mark.skipif(bool(gpu_build.missing_tools()), reason=(
    f"the triton wheel lacks {', '.join(gpu_build.missing_tools())} at {gpu_build.BIN}"))


def _build(*args: str, tmp_path) -> tuple[int, str, list[list[str]]]:
    """Run the build check; its exit code, output and the cells of its markdown table's rows."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "table.md"
    p = subprocess.run([sys.executable, "-m", "trimpass.testing.gpu_build", *args, "--out",
                        str(out)], capture_output=True, text=True, env=env, timeout=300)
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.read_text().splitlines()
            if line.startswith(("| head ", "| admit "))] if out.exists() else []
    return p.returncode, p.stdout + p.stderr, rows


@needs_tools
def test_ci_subset_builds_clean(tmp_path):
    """Every config of the head for M = 1 and 64 (bf16, fp32) and the admission kernel, sm_80 and
    sm_90: no spill, at most 128 registers where M <= 16, 16-byte weight loads."""
    code, output, rows = _build("--ci", tmp_path=tmp_path)
    assert code == 0, output[-3000:]
    built = {(r[0], r[1], r[4]) for r in rows}
    for arch in ("sm_80", "sm_90"):
        assert {("head", arch, "1"), ("head", arch, "64"), ("admit", arch, "1")} <= built
    for kernel, _, _, _, m, config, regs, stack, _, loads, _, _, status in rows:
        assert status == "ok" and int(stack) <= 16, (kernel, config, status)
        if kernel == "head":
            wide, total = map(int, loads.split("/"))
            assert total > 0 and wide == total, (config, loads)
            assert int(m) > 16 or int(regs) <= 128, (config, regs)


@needs_tools
def test_planted_spilling_config_fails_the_check(tmp_path):
    """A 128 x 256 tile with 128-wide blocks of d cannot fit in registers: the check must say so
    and exit 1, while the shipped configs built beside it pass."""
    code, output, rows = _build("--plant", "128,256,128,8,3", "--arch", "80", "--dtype", "bf16",
                                "--head", "gemma3-270m", "--rows", "64", "--mode", "compact",
                                "--admit-ids", tmp_path=tmp_path)
    assert code == 1, output[-3000:]
    planted = [r for r in rows if r[5] == "m128 k256 d128 w8 s3"]
    assert len(planted) == 1 and int(planted[0][7]) > 16, planted
    assert "FAILED head sm_80 bf16" in output and "registers spill" in output
    assert all(r[-1] == "ok" for r in rows if r is not planted[0])


@pytest.mark.parametrize("d,divisible", [(640, True), (641, False)])
def test_builds_carry_the_jits_specialization(d, divisible):
    """triton's binder, run on the launcher's arguments: a row count of 1 becomes a constant,
    16-byte-aligned pointers and multiples of 16 are marked divisible by 16, others are not."""
    from trimpass.kernels import trimmed_head as th
    fn = gpu_build.jit_function(th._trimmed_head_kernel)
    x = torch.empty(1, 1, d, device="meta", dtype=torch.float16)
    w = torch.empty(1000, d, device="meta", dtype=torch.float16)
    idx = torch.empty(1, 4096, device="meta", dtype=torch.int64)
    count = torch.empty(1, device="meta", dtype=torch.int32)
    out = torch.empty(1, 1, 4096, device="meta", dtype=torch.float16)
    args, flags = th.launch_args(x, w, idx, count, None, 1.0, 0.0, out, False, True)
    config = th.CONFIGS[0].all_kwargs()
    _, signature, constexprs, attrs, _ = gpu_build.specialize(fn, 90, args, {**flags, **config})
    names = fn.arg_names
    assert signature["R"] == "constexpr" and constexprs[(names.index("R"),)] == 1
    assert signature["w_ptr"] == "*fp16"
    div16 = [["tt.divisibility", 16]]
    assert attrs[(names.index("w_ptr"),)] == div16
    assert (attrs[(names.index("stride_wv"),)] == div16) is divisible
    assert (attrs[(names.index("D"),)] == div16) is divisible


def test_parsers_read_the_tools_output():
    res = gpu_build.parse_resources(
        "Resource usage:\n Common:\n  GLOBAL:0\n Function _k:\n  REG:46 STACK:24 SHARED:1024 "
        "LOCAL:0 CONSTANT[0]:632 TEXTURE:0 SURFACE:0 SAMPLER:0\n")
    assert res == dict(regs=46, stack=24, shared=1024, local=0)
    llir = "\n".join([
        '  %1 = tail call i32 asm sideeffect "ld.global.b32 { $0 }, [ $1 + 0 ];", "=r,l"(ptr %0)'
        ' #6, !dbg !18',
        '  %2 = tail call { i32, i32, i32, i32 } asm sideeffect "@$5 ld.global.v4.b32 { $0, $1, '
        '$2, $3 }, [ $4 + 0 ];", "=r,=r,=r,=r,l,b"(ptr %3, i1 %4) #6, !dbg !51',
        '  %5 = tail call i16 asm sideeffect "@$2 ld.global.b16 { $0 }, [ $1 + 0 ];", '
        '"=c,l,b"(ptr %6, i1 %7) #6, !dbg !51',
        '  tail call void asm sideeffect "@$0 cp.async.cg.shared.global [ $1 + 0 ], [ $2 + 0 ], '
        '0x10, $3;", "b,r,l,r"(i1 %8, ptr addrspace(3) %9, ptr %10, i32 %11) #6, !dbg !52',
        "!18 = !DILocation(line: 39, column: 24, scope: !4)",
        "!51 = !DILocation(line: 61, column: 17, scope: !4)",
        "!52 = !DILocation(line: 73, column: 17, scope: !4)",
    ])
    assert gpu_build.parse_loads(llir, {61, 73}) == [16, 2, 16]
    assert gpu_build.parse_loads(llir, {39}) == [4]
    sass = ("/*0810*/ @P1 LDG.E.128 R4, desc[UR16][R22.64] ;\n/*0760*/ @P0 LDG.E.U16 R12, "
            "desc[UR16][R8.64] ;\n/*0a50*/ LDGSTS.E.BYPASS.LTC128B.128 [R24+0x4000], "
            "desc[UR10][R4.64], P6 ;\n/*0ab0*/ LDGDEPBAR ;\n/*00c0*/ LDG.E.64 R2, "
            "desc[UR10][R2.64]")
    assert gpu_build.sass_wide_loads(sass) == 2
