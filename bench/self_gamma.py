"""The self-drafter's draft length, measured: the real Gemma-3-270M drafting for itself through
``trimpass.self_drafter`` in Hugging Face assisted generation, at each fixed draft length and with
a confidence stop (drafting until the trimmed confidence drops below Hugging Face's default
threshold), each run in turn with the plain target on each held-out prompt; tokens/s over the plain
target run beside it, MAT, acceptance and draft ms per call. bf16 with the target verifying
row-invariantly (lossless checked against it) or fp32. Prints a table and writes a PNG.

    python bench/self_gamma.py --prompts 4 --new-tokens 64 --gammas 2 3 4 6 8 --dynamic
"""
from __future__ import annotations

import argparse
import copy
import os

import torch


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="held-out ShareGPT prompts")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt")
    ap.add_argument("--prompt-tokens", type=int, default=96, help="prompt length cap")
    ap.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4, 6, 8],
                    help="fixed draft lengths to measure")
    ap.add_argument("--dynamic", action="store_true",
                    help="also draft until the trimmed confidence drops below HF's default "
                    "threshold (at most --confidence-max tokens)")
    ap.add_argument("--confidence-max", type=int, default=16,
                    help="the longest draft with --dynamic")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="model dtype (auto: bf16 where this CPU has native bf16, else fp32)")
    ap.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"],
                    help="the drafter's inner compiler")
    ap.add_argument("--out", default="out", help="folder for self_gamma.png")
    a = ap.parse_args(argv)
    for name in ("prompts", "new_tokens", "prompt_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    if any(g < 1 or g > 32 for g in a.gammas):
        ap.error("argument --gammas: each must be in [1, 32]")
    return a


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    names = [r["name"] for r in rows]
    speed = [r["speedup"] for r in rows]
    ax.bar(names, speed, color="tab:green", label="tokens/s ÷ the plain target's, run beside it")
    ax.axhline(1.0, color="black", ls="--", lw=1, label="the plain target (x1.00)")
    for i, r in enumerate(rows):
        ax.text(i, r["speedup"], f"x{r['speedup']:.2f}\nMAT {r['mat']:.2f}", ha="center",
                va="bottom", fontsize=7)
    ax.set_ylim(0, 1.35 * max(speed + [1.0]))
    ax.set_ylabel("speedup over the plain target")
    ax.set_xlabel("draft length per verification")
    ax.set_title("Gemma-3-270M drafting for itself, trimmed zero-config", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


@torch.no_grad()
def main(argv=None) -> int:
    a = _args(argv)
    import transformers

    import trimpass
    from trimpass import dtypes
    from trimpass.hf import assisted, exact
    from trimpass.hf import gemma as G
    from trimpass.loops.stats import LoopStats
    from trimpass.select.corpora import held_out_prompts
    from trimpass.testing.checks import head_runs
    transformers.logging.set_verbosity_error()
    dtype = dtypes.settle(a)
    plain = G.load_model(dtype)
    model = plain
    if dtype == torch.bfloat16:
        model = copy.deepcopy(plain)
        exact.use(model)
    prompts = held_out_prompts(G.GGUFTokenizer(), a.prompts, a.prompt_tokens)
    _, refs = assisted.run(model, None, prompts, a.new_tokens, "target alone")
    schedules = [(str(g), g) for g in a.gammas]
    schedules += [(f"up to {a.confidence_max}, confidence stop", None)] if a.dynamic else []
    rows = []
    for name, gamma in schedules:
        torch._dynamo.reset()
        stop = transformers.GenerationConfig().assistant_confidence_threshold  # HF's 0.4
        draft = trimpass.self_drafter(model, gamma=gamma or a.confidence_max,
                                      confidence=0.0 if gamma else stop, inner=a.inner)
        assisted.run(model, draft, prompts, a.new_tokens, "warm-up")  # every length timed below
        assisted.warm_up(model, draft, prompts)
        graphs = assisted.compiled_graphs()
        st, alone = LoopStats(name), LoopStats("target beside")
        with head_runs(draft) as runs:
            for k, p in enumerate(prompts):
                alone.merge(assisted.run(plain, None, [p], a.new_tokens, "target")[0])
                st.merge(assisted.run(model, draft, [p], a.new_tokens, name, refs[k:k + 1])[0])
        runs.check()
        graphs = assisted.compiled_graphs() - graphs
        print(f"{name}: done ({graphs} graphs compiled while timed)", flush=True)
        rows.append(dict(compiled=graphs, name=name, speedup=st.tokens_per_s / alone.tokens_per_s,
                         mat=st.mat,
                         acc=st.acceptance, draft_ms=st.draft_ms, tps=st.tokens_per_s,
                         beside=alone.tokens_per_s, lossless=st.lossless))
    print(f"\nGemma-3-270M drafting for itself (trimpass.self_drafter, zero-config), {a.dtype}, "
          f"{len(prompts)} held-out prompts x {a.new_tokens} tokens, inner {a.inner}")
    print("| draft length | MAT | acceptance | draft ms / call | tokens/s | plain target beside "
          "| speedup | graphs compiled while timed | lossless |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['mat']:.2f} | {r['acc']:.2f} | {r['draft_ms']:.2f} | "
              f"{r['tps']:.2f} | {r['beside']:.2f} | x{r['speedup']:.2f} | {r['compiled']} | "
              f"{'✓' if r['lossless'] else '✗'} |")
    os.makedirs(a.out, exist_ok=True)
    _plot(rows, os.path.join(a.out, "self_gamma.png"))
    print(f"plot: {os.path.join(a.out, 'self_gamma.png')}")
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
