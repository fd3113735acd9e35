"""Teacher-forced coverage of the dynamic vocabulary on real token streams, against static top-K.

Each held-out document is fed one token at a time through the state's real ``trimpass::admit`` op
(the op the pass splices into the compiled drafter): ShareGPT conversations (the prompt turn
admitted as context, the assistant turn scored), stdlib code and pydoc prose. A step counts as
covered when the next token is already active; the active size includes the core set. Static top-K
lists come from the counting split of the same corpus. Writes a PNG of coverage against mean active
size and a JSON of the numbers.

    python bench/dynamic_coverage.py --tokenizer qwen2.5 --docs 60 --out out/
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

from trimpass.config import TrimConfig
from trimpass.progress import progress
from trimpass.select import corpora, counts, tokenizers
from trimpass.state import ActiveState

CORPORA = ("sharegpt", "stdlib", "pydoc")


def streams(spec: str, enc, n: int, max_tokens: int):
    out = []
    for d in corpora.read(spec):
        if not corpora.held_out(d.doc_id):
            continue
        ctx = enc.encode_batch([d.prompt])[0][:max_tokens] if d.prompt else np.zeros(0, np.int64)
        body = enc.encode_batch([d.text])[0][:max_tokens]
        if len(body) >= 32:
            out.append((ctx, body))
        if len(out) == n:
            break
    return out


def dynamic(docs, V: int, core: np.ndarray | None, capacity: int):
    hits = sizes = 0
    steps = 0
    for ctx, body in docs:
        st = ActiveState(TrimConfig(capacity=capacity, core=None if core is None else
                                    torch.from_numpy(core)))
        b = st.buffers(1, V, "cpu")
        if len(ctx):
            st.admit(torch.from_numpy(ctx)[None])
        for t in body.tolist():
            hits += int(b["slot"][0, t]) >= 0
            sizes += int(b["count"][0])
            steps += 1
            st.admit(torch.tensor([[t]]))
    return hits / steps, sizes / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="qwen2.5")
    ap.add_argument("--docs", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    enc = tokenizers.get(a.tokenizer)
    V = enc.vocab_size
    res = {}
    for spec in CORPORA:
        c = counts.count(enc, spec)
        rank = counts.ranking(c.train)
        docs = streams(spec, enc, a.docs, a.max_tokens)
        scored = np.concatenate([b for _, b in docs])
        held = np.bincount(scored, minlength=V)
        static = {K: float(counts.coverage_curve(rank[:K], held)[-1])
                  for K in (1000, 3000, 8000, 16000, 32000, 64000) if K <= V}
        dyn = {}
        for name, core in progress([("context", None), ("context+core1k", rank[:1000]),
                                    ("context+core2k", rank[:2000])], desc=spec):
            dyn[name] = dynamic(docs, V, core, a.capacity)
        res[spec] = dict(static=static, dynamic=dyn, steps=int(len(scored)))
        print(f"\n{spec} ({a.tokenizer}, {len(docs)} held-out docs, {len(scored):,} scored steps)")
        print("| set | coverage | mean active ids |\n|---|---|---|")
        for K, cov in static.items():
            print(f"| static top-{K // 1000}k | {cov:.3f} | {K:,} |")
        for name, (cov, size) in dyn.items():
            print(f"| {name} | {cov:.3f} | {size:,.0f} |")
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"dynamic_coverage_{a.tokenizer}")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(res), figsize=(4 * len(res), 3.6), dpi=110, sharey=True)
    for ax, (spec, r) in zip(np.atleast_1d(axes), res.items()):
        ks = list(r["static"])
        ax.plot(ks, [r["static"][k] for k in ks], "o-", label="static top-K")
        for name, (cov, size) in r["dynamic"].items():
            ax.scatter([size], [cov], marker="*", s=120, label=name)
        ax.set_xscale("log")
        ax.set_title(spec)
        ax.set_xlabel("active ids (mean)")
    np.atleast_1d(axes)[0].set_ylabel("next-token coverage")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.suptitle(f"teacher-forced coverage, {a.tokenizer}", fontsize=10)
    fig.tight_layout()
    fig.savefig(base + ".png")
    print(f"\nwrote {base}.png and {base}.json")


if __name__ == "__main__":
    main()
