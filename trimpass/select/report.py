"""The ``select`` command's work: count, search, save the vocabulary, a JSON report and a PNG."""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from trimpass.select import costmodel, interop, tokenizers, tpe
from trimpass.select import counts as counting
from trimpass.shapes import DRAFTERS


def plot(sel: tpe.Selection, c_min: float, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ks, cov, red = (np.array(x) for x in zip(*sel.frontier, strict=True))
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    sc = ax.scatter(red * 100, cov * 100, c=np.log10(ks), cmap="viridis", s=14)
    ax.axhline(c_min * 100, color="grey", ls="--", lw=1, label=f"min coverage {c_min:.0%}")
    mean_cov = float(np.mean(list(sel.coverage.values())))
    ax.scatter([sel.reduction * 100], [mean_cov * 100], marker="*", s=220, c="crimson",
               label=f"chosen K={sel.K:,}", zorder=3)
    ax.set_xlabel("predicted latency reduction (%)")
    ax.set_ylabel("held-out coverage (%)")
    ax.set_title(title, fontsize=10)
    fig.colorbar(sc, ax=ax, label="log10 K")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args) -> dict:
    tpe.check_args(args.alpha, args.min_coverage)
    enc = tokenizers.get(args.tokenizer)
    head_v = args.vocab_size or (DRAFTERS[args.drafter].V if args.drafter else
                                 enc.vocab_size)
    if enc.vocab_size > head_v:
        raise ValueError(f"tokenizer {args.tokenizer}: {enc.vocab_size} ids do not fit a head of "
                         f"{head_v} rows; pick the drafter's own tokenizer or --vocab-size")
    cs = [counting.count(enc, spec) for spec in args.corpus]
    if args.cost == "flops":
        cost = (costmodel.FlopsModel.named(args.drafter) if args.drafter else
                costmodel.FlopsModel(18, 640, 2048, head_v))
    else:
        d = DRAFTERS[args.drafter].d if args.drafter else 640
        cost = costmodel.MeasuredModel.measure(head_v, d)
    sel = tpe.select(cs, cost, args.alpha, args.min_coverage, args.trials, args.max_k,
                     keep=args.keep or ())
    rank_all = counting.ranking(sum(c.train / max(c.train.sum(), 1) for c in cs), args.keep or ())
    evals = {}
    for spec in args.eval or []:
        c = counting.count(enc, spec)
        evals[spec] = float(np.isin(np.arange(len(c.held)), sel.ids) @ c.held / c.held.sum())
    base, _ = os.path.splitext(args.out)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    torch.save(torch.from_numpy(sel.ids.astype(np.int64)), args.out)
    if args.export_sglang:
        interop.export_sglang(sel.ids, args.export_sglang)
    if args.export_eagle3:
        interop.export_eagle3(sel.ids, head_v, args.export_eagle3)
    png = base + ".png"
    plot(sel, args.min_coverage, png, f"{args.tokenizer} on {', '.join(args.corpus)} "
         f"(alpha={args.alpha}, cost={args.cost})")
    report = dict(
        tokenizer=args.tokenizer, corpora=args.corpus, K=sel.K, alpha=args.alpha,
        min_coverage=args.min_coverage, cost_model=args.cost, head_vocab_size=head_v,
        heldout_coverage=sel.coverage, eval_coverage=evals, predicted_reduction=sel.reduction,
        utility=sel.utility, weights=sel.weights, trials=sel.trials,
        static_topk_coverage={f"top{k}": float(np.mean([counting.coverage_curve(
            rank_all[:k], c.held)[-1] for c in cs])) for k in (1000, 3000, 8000, 16000, 32000)
            if k <= head_v},
        counting={c.corpus: dict(docs=c.docs, skipped=c.skipped, reasons=c.reasons,
                                 tokens=int(c.train.sum() + c.held.sum()),
                                 counting_tokens_per_s=c.tokens_per_s_counting) for c in cs},
        frontier=sel.frontier, out=args.out, png=png)
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=1)
    return report
