"""gpu_check's sections for the whole drafter step and the op's host cost.

``step_section``, one gpu_check section per drafter shape (``shape_names``), random weights: an
EAGLE-3 drafter for Llama-3-8B (``EagleDrafter``, V = 128,256, d = 4,096) and a Gemma-3-270M-shaped
decoder (``Transformer``, 18 layers, V = 262,144, d = 640, a static KV cache), each compiled
untrimmed and through the trimpass backend (dynamic mode) under ``mode="reduce-overhead"`` on a GPU.
Per shape: the trimmed logits against the untrimmed ones on the active ids; what CUDA-graph trees
read from the graph (:class:`trimpass.testing.capture.CaptureCheck`: every parameter a static input,
no mutated input that is not static); the step's time side by side; and, under the profiler, the
copy ops per replay and how many of them are weight-sized (a non-static weight is copied into the
graph's pool on every replay). ``host_section``: the host time of one Python-launched
``head_compact`` call, with the launch cache warm and emptied before every call, beside
``F.linear``'s, timed as the host's loop time with the GPU left to run behind it. On the dry run
(CPU, tiny sizes) the code runs and the speed checks are skipped."""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from trimpass.measure import compiled_graphs

WEIGHT_BYTES = 1 << 20  # a copy at least this large per replay is counted as weight-sized


def _shapes(gpu: bool):
    from trimpass.shapes import DRAFTERS
    e, g = DRAFTERS["eagle-llama3-8b"], DRAFTERS["gemma3-270m"]
    if gpu:
        return {"eagle-llama3-8b": (e.V, e.d, e.heads, e.ffn, e.layers, 0.5),
                "gemma3-270m": (g.V, g.d, g.heads, g.ffn, g.layers, 0.6)}
    return {"eagle-llama3-8b": (1_031, 64, 4, 128, 1, 0.5),
            "gemma3-270m": (1_031, 64, 4, 128, 2, 0.6)}


def _model(name, V, d, heads, ffn, layers, device, dtype):
    from trimpass.testing.models import EagleDrafter, Transformer
    torch.manual_seed(0)
    if name.startswith("eagle"):
        m = EagleDrafter(V, d, heads, ffn).to(device, dtype).eval()
        step = (torch.randint(0, V, (1, 1), device=device),
                torch.randn(1, 1, d, device=device, dtype=dtype))
        return m, step, (torch.randint(0, V, (1, 64), device=device),
                         torch.randn(1, 64, d, device=device, dtype=dtype))
    m = Transformer(V, d, layers=layers, n_heads=heads, ffn=ffn, tied=True).to(device, dtype).eval()
    m.setup_caches(1, 256)
    step = (torch.randint(0, V, (1, 1), device=device), torch.tensor([64], device=device))
    return m, step, (torch.randint(0, V, (1, 64), device=device), torch.arange(64, device=device))


def copies_per_call(fn, calls: int = 5) -> tuple[float, float]:
    """(copy ops, weight-sized copy ops) per call of ``fn`` under the profiler."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, record_shapes=True) as prof:
        for _ in range(calls):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    n = big = 0
    for e in prof.events():
        if e.name not in ("aten::copy_", "aten::_foreach_copy_"):
            continue
        n += 1
        numel = max((math.prod(s) for s in _shapes_in(e.input_shapes)), default=0)
        big += numel * 2 >= WEIGHT_BYTES
    return n / calls, big / calls


def _shapes_in(nested):
    if isinstance(nested, (list, tuple)) and nested and all(isinstance(v, int) for v in nested):
        yield nested
    elif isinstance(nested, (list, tuple)):
        for v in nested:
            yield from _shapes_in(v)


def _compare(c, name, spec, device, dtype, tol, bench_ms, rel_err) -> dict:
    import trimpass
    from trimpass.testing.capture import CaptureCheck
    V, d, heads, ffn, layers, target = spec
    gpu = device == "cuda"
    mode = "reduce-overhead" if gpu else None
    model, step, context = _model(name, V, d, heads, ffn, layers, device, dtype)
    cap = 4096 if gpu else 64
    inner = "inductor" if gpu else "aot_eager"
    settings = dict(capacity=cap, learn_core=1024 if gpu else 16, mode=mode)
    out, logits, copies, timed_graphs = {}, {}, {}, {}
    with torch.no_grad():
        for label in ("untrimmed", "trimmed"):
            torch._dynamo.reset()
            fn = torch.compile(model, backend=inner, mode=mode) if label == "untrimmed" else \
                torch.compile(model, backend=trimpass.backend(inner=inner, **settings))
            fn(*context)  # the request's context: the ids seen, the KV cache's first positions
            fn(*step)  # compiled (and captured) before the timing
            graphs = compiled_graphs()
            out[label] = bench_ms(lambda fn=fn: fn(*step))
            copies[label] = copies_per_call(lambda fn=fn: fn(*step))
            timed_graphs[label] = compiled_graphs() - graphs
            logits[label] = fn(*step)[0].float().clone()  # CUDA-graph outputs are reused
        torch._dynamo.reset()
        cc = CaptureCheck()  # the same trimmed step, read as CUDA-graph trees would see it
        fn = torch.compile(model, backend=trimpass.backend(inner=cc, **settings))
        fn(*context)
        fn(*step)
    full, trim = logits["untrimmed"], logits["trimmed"]
    live = torch.isfinite(trim)
    n_live = int(live.sum())
    c.check(f"step {name}: between 1 and capacity ids active, -inf elsewhere",
            0 < n_live <= cap and bool(torch.isneginf(trim[~live]).all()), f"{n_live:,} active")
    err = rel_err(trim[live], full[live]) if n_live else float("nan")
    c.within(f"step {name}: trimmed logits match the untrimmed ones on the active ids", err, tol)
    c.check(f"step {name}: CUDA-graph trees see every weight static, no mutated non-static "
            "input", not cc.problems() and cc.graphs, "; ".join(cc.problems()) or
            f"{len(cc.graphs)} graph(s), {len(cc.graphs[0].parameters)} parameters static")
    ratio = out["trimmed"] / out["untrimmed"]
    if gpu:
        c.check(f"step {name}: no weight-sized copy per replay", copies["trimmed"][1] == 0,
                f"{copies['trimmed'][1]:.0f} weight-sized of {copies['trimmed'][0]:.0f} copy ops "
                f"per call (untrimmed: {copies['untrimmed'][1]:.0f} of "
                f"{copies['untrimmed'][0]:.0f})")
        c.check(f"step {name}: trimmed step <= {target}x the untrimmed one", ratio <= target,
                f"{out['trimmed']:.4f} ms vs {out['untrimmed']:.4f} ms (x{ratio:.2f})")
    else:
        c.skip(f"step {name}: speed and copies", "dry run: no CUDA graphs, timings mean nothing")
    return dict(section="step", shape=name, V=V, d=d, layers=layers, mode=str(mode),
                untrimmed_ms=out["untrimmed"], trimmed_ms=out["trimmed"], ratio=ratio,
                copies_trimmed=copies["trimmed"], copies_untrimmed=copies["untrimmed"],
                rel_err=err, active=n_live, graphs_while_timed=timed_graphs)


def shape_names() -> list[str]:
    """The drafter shapes, each its own gpu_check section: one failing hides not the other."""
    return list(_shapes(False))


def step_section(c, device, dtype, tol, bench_ms, rel_err, shape: str) -> list[dict]:
    r = _compare(c, shape, _shapes(device == "cuda")[shape], device, dtype, tol, bench_ms,
                 rel_err)
    (n, b), (n0, b0) = r["copies_trimmed"], r["copies_untrimmed"]
    print(f"\n## drafter step {shape}, trimmed (dynamic mode) vs untrimmed ({dtype}, "
          f"mode={r['mode']})")
    print("| shape | untrimmed ms | trimmed ms | trimmed / untrimmed | copies per call, trimmed "
          "(weight-sized) | untrimmed | graphs compiled while timed |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {r['shape']} (V={r['V']:,}, d={r['d']:,}, {r['layers']} layers) | "
          f"{r['untrimmed_ms']:.4f} | {r['trimmed_ms']:.4f} | x{r['ratio']:.2f} | "
          f"{n:.0f} ({b:.0f}) | {n0:.0f} ({b0:.0f}) | {sum(r['graphs_while_timed'].values())} |")
    print("random weights: times only; acceptance comes from CPU runs of the real Gemma\n")
    return [r]


def _host_us(fn, calls: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) * 1e6 / calls  # the loop's host time; the GPU runs behind
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return us


def host_section(c, device, dtype) -> list[dict]:
    from trimpass import ops
    from trimpass.kernels import trimmed_head as th
    gpu = device == "cuda"
    V, d, K, calls = (128_256, 4_096, 4_096, 2_000) if gpu else (1_031, 64, 37, 5)
    w = torch.randn(V, d, device=device, dtype=dtype)
    x = torch.randn(1, d, device=device, dtype=dtype)
    idx = torch.randperm(V, device=device)[:K]
    count = torch.tensor([K], dtype=torch.int32, device=device)
    op = ops.head_compact.default

    def cold():
        th.clear_launch_cache()
        op(x, w, None, idx, count)

    with ops.use_kernel("triton"):
        us = {"head_compact, hot": _host_us(lambda: op(x, w, None, idx, count), calls),
              "head_compact, cold (checks + autotuner)": _host_us(cold, max(calls // 10, 2)),
              "F.linear (cuBLAS's full head)": _host_us(lambda: F.linear(x, w), calls)}
    hot = us["head_compact, hot"]
    if gpu:
        c.check("host: an eager head_compact call costs <= 15 us of host time", hot <= 15,
                f"{hot:.1f} us hot, {us['head_compact, cold (checks + autotuner)']:.1f} cold")
    else:
        c.skip("host: an eager head_compact call costs <= 15 us of host time",
               "dry run: the interpreter runs the kernel on the host")
    print(f"\n## host time of one Python-launched call (V={V:,}, d={d:,}, K={K:,}, one row)")
    print("| call | host us |")
    print("|---|---|")
    for k, v in us.items():
        print(f"| {k} | {v:.1f} |")
    print()
    return [dict(section="host", V=V, d=d, K=K, **{k: v for k, v in us.items()})]
