"""GPU check: the trimmed LM-head op on a CUDA device, bf16, against copy bandwidth and cuBLAS.

On a bare CUDA machine with torch and triton but no network, from the repository root:
    pip install --no-deps --no-build-isolation .   (or: export PYTHONPATH=$PWD; see below)
    python bench/gpu_check.py [--out DIR]
``--dry-run`` runs every section on the CPU under the Triton interpreter at tiny sizes (CI does, so
the script cannot rot); its numbers mean nothing. The whole script stays under 5 minutes on an H200.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny sizes")
    p.add_argument("--out", default=None, help="directory for gpu_check.json")
    return p.parse_args()


ARGS = _args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import trimpass  # noqa: F401
except ImportError:  # not installed: use the checkout (kernels/ maps to trimpass.kernels)
    sys.path.insert(0, ROOT)
    import importlib.util
    import trimpass  # noqa: F401
    spec = importlib.util.spec_from_file_location(
        "trimpass.kernels", os.path.join(ROOT, "kernels", "__init__.py"),
        submodule_search_locations=[os.path.join(ROOT, "kernels")])
    sys.modules["trimpass.kernels"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["trimpass.kernels"])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trimpass import ops  # noqa: E402
from trimpass.kernels import trimmed_head as kernel  # noqa: E402

DEVICE = "cpu" if ARGS.dry_run else "cuda"
DTYPE = torch.float32 if ARGS.dry_run else torch.bfloat16


def bench_ms(fn) -> float:
    if DEVICE == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100)
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3 * 1e3


def copy_gbps() -> float:
    n = (1 << 30) if DEVICE == "cuda" else (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * n / ms / 1e6  # bytes read + written


def head_section() -> list[dict]:
    V, d = (128_256, 4_096) if DEVICE == "cuda" else (1_031, 96)
    ks = (3_000, 8_000, 16_000, 32_000) if DEVICE == "cuda" else (37, 100)
    copy = copy_gbps()
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(V, d, generator=g) / d**0.5).to(DEVICE, DTYPE)
    x = torch.randn(1, d, generator=g).to(DEVICE, DTYPE)
    full_ms = bench_ms(lambda: F.linear(x, w))
    rows = []
    with ops.use_kernel("triton"):
        for K in ks:
            idx = torch.randperm(V, generator=g)[:K].sort().values.to(DEVICE)
            count = torch.tensor([K], dtype=torch.int32, device=DEVICE)
            out = ops.head_compact(x, w, None, idx, count)
            ref = F.linear(x.float(), w[idx].float())
            err = float((out.float() - ref).abs().max() / ref.abs().max())
            ms = bench_ms(lambda: ops.head_compact(x, w, None, idx, count))
            gbps = K * d * w.element_size() / ms / 1e6
            rows.append(dict(section="head", V=V, d=d, K=K, M=1, ms=ms, gbps=gbps,
                             copy_gbps=copy, pct_copy=100 * gbps / copy, full_ms=full_ms,
                             speedup=full_ms / ms, rel_err=err, config=kernel.best_config()))
    print(f"\n## trimmed head, {DTYPE}, V={V:,} d={d:,} M=1 (copy: {copy:,.0f} GB/s)")
    print("| K | trimmed ms | GB/s | % of copy | cuBLAS full ms | full/trimmed | rel err | config |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['K']:,} | {r['ms']:.4f} | {r['gbps']:,.0f} | {r['pct_copy']:.0f}% | "
              f"{r['full_ms']:.4f} | x{r['speedup']:.1f} | {r['rel_err']:.1e} | {r['config']} |")
    return rows


def state_section() -> list[dict]:
    """Cost of one step's state update (admit with successors, then the learned core's count),
    no host sync."""
    from trimpass.config import TrimConfig
    from trimpass.state import ActiveState
    V = 128_256 if DEVICE == "cuda" else 1_031
    cap, learn = (4096, 1024) if DEVICE == "cuda" else (64, 16)
    rows = []
    for B, S in ((1, 1), (1, 8), (8, 1)):
        st = ActiveState(TrimConfig(capacity=cap, learn_core=learn))
        b = st.buffers(B, V, DEVICE)
        ids = torch.randint(0, V, (B, S), device=DEVICE)

        def step():  # the two ops the pass inserts at each token lookup
            torch.ops.trimpass.admit(*st.args(b), ids, None, b["n_core"], st.learned, st.serial,
                                     st.config.successors)
            torch.ops.trimpass.learn(st.learned, ids, 1 << 30, st.serial)
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("error")  # any host sync in the update raises
        ms = bench_ms(step)
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        rows.append(dict(section="state", B=B, S=S, V=V, us=ms * 1e3))
    print(f"\n## dynamic-vocabulary state update (admit with successors + learn), no host sync, "
          f"capacity {cap}")
    print("| B | ids per row | us per step |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['S']} | {r['us']:.1f} |")
    return rows


def e2e_section() -> list[dict]:
    """Draft step of an EAGLE-shaped drafter for Llama-3-8B, trimmed vs not (random weights)."""
    import trimpass
    from trimpass.testing.models import EagleDrafter
    if DEVICE == "cuda":
        V, d, heads, ffn, mode, inner = 128_256, 4_096, 32, 14_336, "reduce-overhead", "inductor"
    else:
        V, d, heads, ffn, mode, inner = 1_031, 64, 4, 128, None, "aot_eager"
    torch.manual_seed(0)
    model = EagleDrafter(V, d, heads, ffn).to(DEVICE, DTYPE).eval()
    ids = torch.randint(0, V, (1, 1), device=DEVICE)
    hidden = torch.randn(1, 1, d, device=DEVICE, dtype=DTYPE)
    out = {}
    with torch.no_grad():
        for label in ("untrimmed", "trimmed"):
            torch._dynamo.reset()
            if label == "untrimmed":
                fn = torch.compile(model, backend=inner, mode=mode) if mode else \
                    torch.compile(model, backend=inner)
            else:
                be = trimpass.backend(capacity=4096 if DEVICE == "cuda" else 64,
                                      learn_core=1024 if DEVICE == "cuda" else 16,
                                      inner=inner, mode=mode)
                fn = torch.compile(model, backend=be)
                fn(torch.randint(0, V, (1, 512 if DEVICE == "cuda" else 16), device=DEVICE),
                   torch.randn(1, 512 if DEVICE == "cuda" else 16, d, device=DEVICE,
                               dtype=DTYPE))  # a prompt's worth of context in the state
            out[label] = bench_ms(lambda: fn(ids, hidden))
    r = dict(section="e2e", V=V, d=d, untrimmed_ms=out["untrimmed"], trimmed_ms=out["trimmed"],
             reduction_pct=100 * (1 - out["trimmed"] / out["untrimmed"]), mode=str(mode))
    print(f"\n## EAGLE-shaped drafter step (V={V:,}, d={d:,}, {DTYPE}, mode={mode})")
    print("| untrimmed ms | trimmed ms | draft step change |")
    print("|---|---|---|")
    print(f"| {r['untrimmed_ms']:.4f} | {r['trimmed_ms']:.4f} | -{r['reduction_pct']:.1f}% |")
    print("MAT: not measured here (random weights); see the demo and bench/dynamic_gemma.py")
    return [r]


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU smoke version")
        return 2
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    print(f"# trimpass gpu_check on {name}; torch {torch.__version__}")
    t0 = time.time()
    results = {"device": name, "head": head_section(), "state": state_section(),
               "e2e": e2e_section()}
    results["seconds"] = time.time() - t0
    print(f"\ntotal {results['seconds']:.0f} s")
    if ARGS.out:
        os.makedirs(ARGS.out, exist_ok=True)
        with open(os.path.join(ARGS.out, "gpu_check.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
