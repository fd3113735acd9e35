"""trimpass against its peers, side by side in one run: the real Gemma-3-270M decoding held-out
prompts greedily as the plain target (Hugging Face ``generate``), as the same body compiled with
the same inner compiler (``trimpass.generate(speculate=False)``), with Hugging Face prompt lookup,
assisted by the shipped 2-layer drafter trimmed, drafting for itself in Hugging Face's loop
untrimmed and trimmed (``trimpass.self_drafter``), and in the fused loop (``trimpass.generate``).
Every configuration runs on each prompt in turn, so the machine's load drifts alike for all; each
row's tokens/s is divided by the plain and by the compiled target's, and its ms per token by the
compiled body-only step (the fused loop's limit). Prints a markdown table and writes a PNG.

    python bench/peers.py --prompts 8 --new-tokens 64 --dtype bf16
"""
from __future__ import annotations

import argparse
import os
import time

import torch


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="held-out ShareGPT prompts")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt")
    ap.add_argument("--prompt-tokens", type=int, default=96, help="prompt length cap")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="model dtype (auto: bf16 where this CPU has native bf16, else fp32)")
    ap.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"],
                    help="the inner compiler of every compiled row")
    ap.add_argument("--out", default="out", help="folder for peers_<dtype>.png")
    a = ap.parse_args(argv)
    for name in ("prompts", "new_tokens", "prompt_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    return a


class Row:
    """One configuration: ``run(ids)`` decodes one prompt and returns the output ids."""

    def __init__(self, name, run, stats=None, draft=None):
        self.name, self.run, self.stats, self.draft = name, run, stats, draft
        self.seconds, self.tokens, self.same, self.outs, self.heads = 0.0, 0, 0, [], 0
        self.graphs = 0  # graphs Dynamo compiled during this row's timed runs


def _rows(model, a):
    import trimpass
    from trimpass.hf import assisted
    from trimpass.hf import gemma as G
    from trimpass.hf.selfdraft import shared_copy
    from trimpass.models import drafter_beside
    from trimpass.spec.config import SelfDraftConfig
    n, inner = a.new_tokens, a.inner

    def hf(**kw):
        return lambda ids: model.generate(ids, do_sample=False, max_new_tokens=n, **kw)

    def fused(**kw):
        return lambda ids: trimpass.generate(model, ids, n, inner=inner, **kw)

    shipped = G.truncated(drafter_beside(model, 2, "shipped"), 2)
    trimpass.trim(shipped, inner=inner)
    untrimmed = shared_copy(model, SelfDraftConfig())
    assisted.compile_drafter(untrimmed, inner)
    trimmed = trimpass.self_drafter(model, inner=inner)
    return [
        Row("plain target (HF generate)", hf()),
        Row(f"target compiled ({inner}), decoding alone", fused(speculate=False)),
        Row("HF prompt lookup (10 tokens)", hf(prompt_lookup_num_tokens=10)),
        Row("shipped 2-layer drafter, trimmed (HF loop)", hf(assistant_model=shipped),
            draft=shipped),
        Row("self-draft untrimmed (HF loop)", hf(assistant_model=untrimmed), draft=untrimmed),
        Row("self-draft trimmed (HF loop, self_drafter)", hf(assistant_model=trimmed),
            draft=trimmed),
        Row("fused loop, gamma 4 (trimpass.generate)", fused(gamma=4, confidence=0.0), True),
        Row("fused loop, default (trimpass.generate)", fused(), True),
    ]


def _body_ms(model, prompt, inner) -> float:
    """Median ms of one compiled body-only step (no head) at the prompt's end."""
    import trimpass
    from trimpass import measure
    trimpass.generate(model, prompt, 2, speculate=False, inner=inner)
    body = model._trimpass_fused.body
    body.fresh_cache(prompt.shape[1], 2)
    body.prefill(prompt)
    P, token = prompt.shape[1], prompt[:, -1:]

    def step():
        body.rollback(P)
        body.run(token, P)

    with torch.no_grad():
        return measure.median_ms(step, torch.device("cpu"))


def _plot(table, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(table) + 1.6), dpi=120)
    names = [r["name"] for r in table]
    ys = range(len(table))
    ax.barh(ys, [r["x_plain"] for r in table], color=["tab:green" if r["x_plain"] > 1 else
                                                       "tab:gray" for r in table])
    ax.axvline(1.0, color="black", ls="--", lw=1)
    for y, r in zip(ys, table, strict=True):
        ax.text(r["x_plain"], y, f" x{r['x_plain']:.2f} plain, x{r['x_compiled']:.2f} compiled",
                va="center", fontsize=7)
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.6 * max(r["x_plain"] for r in table))
    ax.set_xlabel("tokens/s ÷ the plain target's (run on each prompt in turn)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


@torch.no_grad()
def main(argv=None) -> int:
    a = _args(argv)
    import transformers

    import trimpass
    from trimpass import dtypes
    from trimpass.hf import gemma as G
    from trimpass.progress import progress
    from trimpass.select.corpora import held_out_prompts
    from trimpass.testing.checks import head_ops
    transformers.logging.set_verbosity_error()
    # three drafters and the fused loops compile the same HF forward code: Dynamo's default of 8
    # graphs per code object would send the later ones back to eager, untrimmed
    torch._dynamo.config.recompile_limit = 64
    dtype = dtypes.settle(a)
    model = G.load_model(dtype)
    prompts = [torch.tensor([p]) for p in held_out_prompts(G.GGUFTokenizer(), a.prompts,
                                                           a.prompt_tokens)]
    rows = _rows(model, a)
    from trimpass.hf import assisted
    for r in progress(rows, desc="warm-up (compiles)"):
        if r.draft is not None:  # HF's cache differs between calls: until no graph compiles
            assisted.warm_up(model, r.draft, [p[0].tolist() for p in prompts])
        for p in prompts[:2]:
            r.run(p)  # and at the timed length
    from trimpass.hf.fused import FusedStats
    for loop in model.__dict__.get("_trimpass_loops", {}).values():
        loop.stats = FusedStats("fused")  # the loops' counters from here on: the timed runs only
    for p in progress(prompts, desc="each configuration on each prompt"):
        for r in rows:
            t, before, graphs = time.perf_counter(), head_ops(), assisted.compiled_graphs()
            out = r.run(p)
            r.seconds += time.perf_counter() - t
            r.heads += head_ops() - before
            r.graphs += assisted.compiled_graphs() - graphs
            r.tokens += out.shape[1] - p.shape[1]
            r.outs.append(out)
            if r.stats:
                r.stats = trimpass.stats(model)
    body_ms = _body_ms(model, prompts[0], a.inner)
    plain, compiled = rows[0], rows[1]
    tps = {r.name: r.tokens / r.seconds for r in rows}
    table = []
    for r in rows:
        same = sum(torch.equal(x, y) for x, y in zip(r.outs, plain.outs, strict=True))
        body = sum(torch.equal(x, y) for x, y in zip(r.outs, compiled.outs, strict=True))
        ms = 1e3 * r.seconds / r.tokens
        st = r.stats if isinstance(r.stats, dict) else {}
        table.append(dict(name=r.name, tps=tps[r.name], x_plain=tps[r.name] / tps[plain.name],
                          x_compiled=tps[r.name] / tps[compiled.name], ms=ms, limit=ms / body_ms,
                          same=same, mat=st.get("mat"), acc=st.get("acceptance"), heads=r.heads,
                          body=body))
    title = (f"Gemma-3-270M, {a.dtype}, {len(prompts)} held-out prompts x {a.new_tokens} tokens, "
             f"greedy, inner {a.inner}")
    late = "; ".join(f"{r.name} {r.graphs}" for r in rows if r.graphs) or "none"
    print(f"\n{title}; compiled body-only step: {body_ms:.1f} ms; graphs compiled while timed: "
          f"{late}")
    print("| configuration | tokens/s | x plain target | x compiled target | ms / token | "
          "÷ body-only step | MAT (fused) | acceptance (fused) | trimmed head ops | output = "
          "plain target's | = compiled target's |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        mat = f"{t['mat']:.2f}" if t["mat"] is not None else "-"
        acc = f"{t['acc']:.2f}" if t["acc"] is not None else "-"
        print(f"| {t['name']} | {t['tps']:.2f} | x{t['x_plain']:.2f} | x{t['x_compiled']:.2f} | "
              f"{t['ms']:.1f} | {t['limit']:.2f} | {mat} | {acc} | {t['heads']:,} | "
              f"{t['same']}/{len(prompts)} | {t['body']}/{len(prompts)} |")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"peers_{a.dtype}.png")
    _plot(table, path, title)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
