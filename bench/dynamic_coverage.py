"""Teacher-forced coverage of the dynamic vocabulary on real token streams, against static top-K.

Each held-out document is fed one token at a time through a drafter compiled with trimpass in the
dynamic mode (the smallest one: a token lookup and its tied head, so the graph, the pass and the
state ops are the real ones and the weights do not matter): ShareGPT conversations (the prompt turn
is the first call, the assistant turn is scored), stdlib code and pydoc prose (the first token
starts the request). A step counts as covered when the next token is in the active set the head
just read; the active size includes the core set. Static top-K lists come from the counting split
of the same corpus. ``--observe`` (Gemma-3 tokenizer only) also runs the real Gemma-3-270M over
each document as the target and feeds its top-3 at every verified position through
``trimpass.observe``. Writes a PNG of coverage against mean active size and a JSON of the numbers.

    python bench/dynamic_coverage.py --tokenizer qwen2.5 --docs 40 --out out/
    python bench/dynamic_coverage.py --tokenizer gemma3 --count-docs 3000 --observe --out out/
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

import trimpass
from trimpass.progress import progress
from trimpass.select import corpora, counts, tokenizers

CORPORA = ("sharegpt", "stdlib", "pydoc")


def streams(spec: str, enc, n: int, max_tokens: int, held: bool = True):
    """(context, body) token arrays of ``n`` documents from the held-out split (or the other)."""
    out = []
    for d in corpora.read(spec):
        if corpora.held_out(d.doc_id) != held:
            continue
        ctx = enc.encode_batch([d.prompt])[0][:max_tokens] if d.prompt else np.zeros(0, np.int64)
        body = enc.encode_batch([d.text])[0][:max_tokens]
        if len(body) >= 32:
            out.append((ctx, body))
        if len(out) == n:
            break
    return out


class Probe(torch.nn.Module):
    """The smallest drafter: a token lookup, a rotation by position, and its tied head. (The
    position must be used, or Dynamo drops it and the pass sees no request start.)"""

    def __init__(self, V: int):
        super().__init__()
        self.emb = torch.nn.Embedding(V, 8)

    def forward(self, ids, input_pos):
        x = self.emb(ids) * torch.cos(input_pos.to(torch.float32))[None, :, None]
        return torch.nn.functional.linear(x, self.emb.weight)


def target_top3(docs, k: int = 3):
    """The real Gemma-3-270M's top-k for every body token of every doc (None: no context)."""
    from trimpass.hf import gemma
    model = gemma.load_model()
    out = []
    for ctx, body in progress(docs, desc="target"):
        seq = torch.from_numpy(np.concatenate([[2], ctx, body]))
        top = model(seq[None]).logits[0].topk(k, -1).indices  # top[j] predicts seq[j + 1]
        out.append(top[len(ctx):len(ctx) + len(body)])  # row i predicts body[i]
    return out


def dynamic(docs, V: int, capacity: int, core=None, tops=None, warm=(), **config):
    """(coverage, mean active size) of one fresh drafter over ``docs``, after it has served the
    ``warm`` requests (each as one call: they teach the learned core and the successors)."""
    torch._dynamo.reset()
    draft = Probe(V).eval()
    be = trimpass.backend(capacity=capacity, inner="eager", **config,
                          core=None if core is None else torch.from_numpy(core))
    step = torch.compile(draft, backend=be, fullgraph=True, dynamic=True)
    for ctx, body in warm:
        seq = np.concatenate([ctx, body])
        step(torch.from_numpy(seq)[None], torch.arange(len(seq)))
    hits = sizes = steps = 0
    for k, (ctx, body) in enumerate(docs):
        first = ctx if len(ctx) else body[:1]
        step(torch.from_numpy(first)[None], torch.arange(len(first)))
        pos, start = len(first), 0 if len(ctx) else 1
        for i in range(start, len(body)):
            if i > start:
                step(torch.tensor([[int(body[i - 1])]]), torch.tensor([pos]))
                pos += 1
            if tops is not None and i >= 1:  # the target's top-3 at the last verified position
                trimpass.observe(step, tops[k][i - 1].view(1, -1))
            active, n = trimpass.active_ids(step)[0], trimpass.stats(step)["active"][0]
            hits += bool((active[:n] == int(body[i])).any())  # in the set the head just read
            sizes += n
            steps += 1
    return hits / steps, sizes / steps


def plot(res: dict, tokenizer: str, path: str) -> None:
    """Coverage against mean active size, one panel per corpus (``res`` as in the JSON)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(res), figsize=(4 * len(res), 4.6), dpi=110, sharey=True)
    for ax, (spec, r) in zip(np.atleast_1d(axes), res.items(), strict=True):
        ks = sorted(r["static"], key=int)  # int keys, or str keys read back from the JSON
        ax.plot([int(k) for k in ks], [r["static"][k] for k in ks], "o-", label="static top-K")
        for name, (cov, size) in r["dynamic"].items():
            ax.scatter([size], [cov], marker="*", s=120, label=name)
        ax.set_xscale("log")
        ax.set_title(spec)
        ax.set_xlabel("active ids (mean)")
    np.atleast_1d(axes)[0].set_ylabel("next-token coverage")
    handles, labels = np.atleast_1d(axes)[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.suptitle(f"teacher-forced coverage, {tokenizer}", fontsize=10)
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    fig.savefig(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="qwen2.5")
    ap.add_argument("--docs", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--warm", type=int, default=200, help="requests served before scoring, "
                    "unscored, from the counting split (they teach the learned core)")
    ap.add_argument("--count-docs", type=int, help="cap the documents counted for static lists "
                    "(a slow tokenizer: gemma3's is pure Python)")
    ap.add_argument("--observe", action="store_true", help="also feed the real Gemma-3-270M's "
                    "top-3 (gemma3 tokenizer only)")
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    enc = tokenizers.get(a.tokenizer)
    V = enc.vocab_size
    res = {}
    if a.observe and a.tokenizer != "gemma3":
        ap.error("--observe needs --tokenizer gemma3 (the target is the real Gemma-3-270M)")
    torch.set_grad_enabled(False)
    for spec in CORPORA:
        c = counts.count(enc, f"{spec}:{a.count_docs}" if a.count_docs else spec)
        rank = counts.ranking(c.train)
        docs = streams(spec, enc, a.docs, a.max_tokens)
        warm = streams(spec, enc, a.warm, a.max_tokens, held=False)  # traffic seen earlier
        scored = np.concatenate([b for _, b in docs])
        held = np.bincount(scored, minlength=V)
        static = {K: float(counts.coverage_curve(rank[:K], held)[-1])
                  for K in (1000, 3000, 8000, 16000, 32000, 64000) if K <= V}
        off = dict(learn_core=0, successors=0)
        variants = {"context": off, "context+core1k": dict(off, core=rank[:1000]),
                    "context+core2k": dict(off, core=rank[:2000]),
                    "zero-config: context+learned1k (cold)": {},
                    "zero-config: context+learned1k": dict(warm=warm),
                    "context+learned1k+successors4": dict(successors=4, warm=warm),
                    "context+learned2k+successors4": dict(learn_core=2048, successors=4,
                                                          warm=warm),
                    "context+learned2.5k+successors4": dict(learn_core=2560, successors=4,
                                                            warm=warm)}
        if a.observe:
            tops = target_top3(docs)
            variants.update({"context+observe3": dict(off, tops=tops),
                             "zero-config+observe3": dict(warm=warm, tops=tops)})
        dyn = {}
        for name, kw in progress(list(variants.items()), desc=spec):
            dyn[name] = dynamic(docs, V, a.capacity, **kw)
        res[spec] = dict(static=static, dynamic=dyn, steps=int(len(scored)))
        print(f"\n{spec} ({a.tokenizer}, {len(docs)} held-out docs, {len(scored):,} scored steps; "
              f"learned cores warmed on {len(warm)} earlier requests unless cold)")
        print("| set | coverage | mean active ids |\n|---|---|---|")
        for K, cov in static.items():
            print(f"| static top-{K // 1000}k | {cov:.3f} | {K:,} |")
        for name, (cov, size) in dyn.items():
            print(f"| {name} | {cov:.3f} | {size:,.0f} |")
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"dynamic_coverage_{a.tokenizer}")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    plot(res, a.tokenizer, base + ".png")
    print(f"\nwrote {base}.png and {base}.json")


if __name__ == "__main__":
    main()
