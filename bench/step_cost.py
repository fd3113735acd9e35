"""What the trimmed LM head costs inside a compiled drafter, against what it should cost.

Two comparisons, each timed side by side in one run (variants interleaved in an order rotated from
round to round; the median round is reported), in float32 and bfloat16, printed as one table:

1. ``head``: a tiny module holding only a Gemma-3-270M-shaped head (262,144 x 640, one row),
   compiled through ``trimpass.backend(vocab=<K random ids>, inner=<--head-inner>)``, against the
   *anchor*: the same K rows gathered once (``W[ids]``) and multiplied, compiled with the same inner
   compiler (a compact ``[1, K]`` output). The full head is timed after, for scale.
2. ``step``: one decode step (one token after a KV cache of ``--prompt-len`` positions, cropped back
   after every step so all steps are alike) of the real Gemma-3-270M truncated to ``--layers``
   layers, each variant compiled in place with ``--inner``: ``untrimmed``; ``static`` (trimmed to
   the lowest K ids); ``zero-config`` (trimmed, the dynamic mode, its escape path on as by default:
   its gate is checked on every step; this step's drafter is confident, so it does not fire);
   ``zero-config, no escape`` (``escape=None``); ``anchor`` (``lm_head`` replaced by a linear
   layer holding the static variant's K rows: the compact GEMM of part 1 in place, its caches as
   cold as the drafter leaves them); ``no-head`` (``lm_head`` replaced by ``nn.Identity``, so the
   step returns the final hidden state: the limit any trimmed head approaches). The static head's
   cost in the step, ``static - no-head``, is also given against the anchor's, ``anchor -
   no-head``. ``--profile N`` then profiles N steps of ``--profile-variants``
   (torch.profiler, self CPU time per op) and prints the share of trimpass's own ops, the dynamic
   state's included.

libgomp's default spin-waiting makes any two-thread region on a busy 2-core machine stall for a
scheduler slice (~8 ms) whenever the other core is taken; ``--omp-wait passive`` (the default here)
sets ``OMP_WAIT_POLICY=PASSIVE`` before torch loads, which removes those stalls from every variant.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

DTYPES = ("fp32", "bf16")
VARIANTS = ("untrimmed", "static", "zero-config", "zero-config, no escape", "anchor", "no-head")
CONFIGS = {"static": None, "zero-config": {}, "zero-config, no escape": {"escape": None}}
TRIMPASS_OPS = ("trimpass::head_full", "trimpass::head_compact", "trimpass::scatter_full",
                "trimpass::mask_inactive", "trimpass::admit", "trimpass::active",
                "trimpass::learn", "trimpass::refresh")


def head_rows(args, dtype) -> list[tuple[str, float, str]]:
    import torch
    import torch.nn.functional as F

    import trimpass
    from trimpass.measure import interleaved_ms

    V, d, K = 262_144, 640, args.k
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(V, d, generator=g) / d**0.5).to(dtype)
    ids = torch.randperm(V, generator=g)[:K].sort().values
    x = torch.randn(1, d, generator=g).to(dtype)

    def head(weight, backend):
        m = torch.nn.Linear(d, weight.shape[0], bias=False, dtype=dtype).requires_grad_(False)
        m.weight.copy_(weight)
        return torch.compile(m, backend=backend)

    trimmed = head(w, trimpass.backend(vocab=ids, inner=args.head_inner))
    anchor, full = head(w[ids], args.head_inner), head(w, args.head_inner)
    cpu = torch.device("cpu")
    with torch.no_grad():
        out, ref = trimmed(x), F.linear(x, w)
        assert torch.equal(torch.isfinite(out).nonzero()[:, -1], ids), "wrong active ids"
        torch.testing.assert_close(out[:, ids], ref[:, ids])
        ms = interleaved_ms({"trimmed": lambda: trimmed(x), "anchor": lambda: anchor(x)},
                            args.head_rounds, cpu, calls=1)
        ms["full"] = interleaved_ms({"full": lambda: full(x)}, 3, cpu, calls=3)["full"]
    a = ms["anchor"]
    return [(f"head K={K:,}: compact anchor (W[ids] @ x, {args.head_inner})", a, "x1.00"),
            (f"head K={K:,}: trimmed, static (V-sized output)", ms["trimmed"],
             f"x{ms['trimmed'] / a:.2f} of anchor"),
            ("head: full, untrimmed", ms["full"], f"x{ms['full'] / a:.1f} of anchor")]


def _drafter(model, variant: str, args):
    import torch

    import trimpass
    from trimpass.hf import gemma
    draft = gemma.truncated(model, args.layers)
    if variant == "no-head":
        draft.lm_head = torch.nn.Identity()
    if variant == "anchor":
        rows = draft.lm_head.weight[:args.k].detach().clone()  # the static variant's K ids
        draft.lm_head = torch.nn.Linear(rows.shape[1], args.k, bias=False, dtype=rows.dtype)
        draft.lm_head.weight = torch.nn.Parameter(rows, requires_grad=False)
    if variant in CONFIGS:
        cfg = CONFIGS[variant] if variant != "static" else dict(vocab=list(range(args.k)))
        trimpass.trim(draft, inner=args.inner, **cfg)
    else:
        draft.compile(backend=args.inner)
    return draft


def _decoder(draft, prompt):
    """A zero-argument decode step: one token after ``prompt``'s cached positions."""
    import torch
    from transformers import DynamicCache
    L = prompt.shape[1]
    cache = DynamicCache(config=draft.config)
    with torch.no_grad():
        draft(input_ids=prompt, past_key_values=cache, use_cache=True,
              cache_position=torch.arange(L), position_ids=torch.arange(L)[None])
    tok, pos = prompt[:, -1:], torch.tensor([L])

    def step():
        logits = draft(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos,
                       position_ids=pos[None]).logits
        cache.crop(-1)  # back to the prompt's positions: every step is the same step
        return logits
    return step


def step_rows(model, args, dtype) -> list[tuple[str, float, str]]:
    import torch

    from trimpass.measure import interleaved_ms
    model = model.to(dtype)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 20_000, (1, args.prompt_len), generator=g)
    steps = {v: _decoder(_drafter(model, v, args), prompt) for v in VARIANTS}
    with torch.no_grad():
        full, static = steps["untrimmed"](), steps["static"]()
        torch.testing.assert_close(static[..., :args.k], full[..., :args.k])
        torch.testing.assert_close(steps["anchor"](), full[..., :args.k])
        assert torch.isneginf(static[..., args.k:]).all(), "static: an inactive id is not -inf"
        ms = interleaved_ms(steps, args.rounds, torch.device("cpu"), calls=args.calls)
        for v in args.profile_variants if args.profile else ():
            profile(f"{v}, {model.dtype}", steps[v], ms[v], args)
    base = ms["no-head"]
    head = (ms["static"] - base) / (ms["anchor"] - base)
    return [(f"{args.layers}-layer step: {v}", ms[v], f"x{ms[v] / base:.2f} of no-head")
            for v in VARIANTS] + [
        (f"{args.layers}-layer step: the static head's cost, static - no-head",
         ms["static"] - base, f"x{head:.2f} of the anchor's (anchor - no-head)")]


def profile(name: str, step, step_ms: float, args) -> None:
    import torch
    from torch.profiler import ProfilerActivity
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(args.profile):
            step()
    ev = p.key_averages()
    n = args.profile
    total = sum(e.self_cpu_time_total for e in ev) / 1e3 / n
    print(f"\nprofile, {n} steps of {name} (the profiler adds overhead: read shares): "
          f"{total:.2f} ms/step profiled, {step_ms:.2f} ms/step timed")
    for e in ev:
        if e.key in TRIMPASS_OPS:
            ms = e.cpu_time_total / 1e3 / n
            print(f"  {e.key}: {ms:.3f} ms/step with its children ({100 * ms / total:.1f}%)")
    print(ev.table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Read the ratios: this machine is shared, absolute ms drift from run to run. "
        "Example: python bench/step_cost.py --parts step --dtypes bf16 --profile 20")
    p.add_argument("--parts", nargs="+", choices=["head", "step"], default=["head", "step"],
                   help="what to time (default: both)")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES),
                   help="dtypes (default: both)")
    p.add_argument("-k", type=int, default=3000,
                   help="static vocabulary size (default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="drafter layers (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=64,
                   help="cached positions before the timed step (default: %(default)s)")
    p.add_argument("--inner", default="aot_eager",
                   help="inner compiler of the drafters (default: %(default)s)")
    p.add_argument("--head-inner", default="inductor",
                   help="inner compiler of the head-only modules (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=41,
                   help="interleaved rounds of drafter steps (default: %(default)s)")
    p.add_argument("--head-rounds", type=int, default=301,
                   help="interleaved rounds of head calls (default: %(default)s)")
    p.add_argument("--calls", type=int, default=1,
                   help="back-to-back steps per round, averaged; 1 makes the reported median a "
                   "median step (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (default: torch's choice)")
    p.add_argument("--omp-wait", choices=["passive", "default"], default="passive",
                   help="libgomp's waiting: passive (no spin-wait stalls on a shared machine) or "
                   "as the environment has it (default: %(default)s)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after timing, profile this many steps (default: off)")
    p.add_argument("--profile-variants", nargs="+", choices=VARIANTS, default=["zero-config"],
                   metavar="VARIANT", help=f"steps to profile, of {', '.join(VARIANTS)} "
                   "(default: zero-config)")
    p.add_argument("--profile-rows", type=int, default=15,
                   help="ops listed per profile (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.omp_wait == "passive":
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads
    os.environ.setdefault("TRITON_INTERPRET", "0")
    import torch

    import trimpass
    if args.threads:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64
    warnings.filterwarnings("ignore", category=trimpass.TrimpassWarning)
    model = None
    if "step" in args.parts:
        from trimpass.hf import gemma
        model = gemma.load_model()
    rows = []
    for dt in args.dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
        if "head" in args.parts:
            rows += [(dt, *r) for r in head_rows(args, dtype)]
        if "step" in args.parts:
            rows += [(dt, *r) for r in step_rows(model, args, dtype)]
    rounds = {"head": args.head_rounds, "step": args.rounds}
    print(f"\n{torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}, torch {torch.__version__}; medians of "
          + ", ".join(f"{rounds[p]} ({p})" for p in args.parts) + " interleaved rounds")
    print("| dtype | variant | ms | ratio |\n|---|---|---|---|")
    for dt, name, ms, ratio in rows:
        print(f"| {dt} | {name} | {ms:.3f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
