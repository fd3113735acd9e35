"""Every prompt, first call to last: the real Gemma-3-270M decoding a stream of prompts of distinct
lengths (8 to 1,024 tokens, real text: held-out ShareGPT prompts, then held-out pydoc topics for the
long ones) greedily, as a user would: Dynamo at its defaults, each route warmed by one untimed call
on a prompt outside the stream, then timed over the stream with any later compile included. Routes:
the plain target (Hugging Face ``generate``), the fused loop (``trimpass.generate``), Hugging Face's
assisted generation with the model drafting for itself (``trimpass.self_drafter``, warmed by
``trimpass.warm_up``), and Hugging Face prompt lookup. Each prompt runs every route in turn, so the
machine's load drifts alike for all. Per route: tokens/s against plain, graphs compiled after the
warm-up, the warm-up's seconds and graphs, and every divergence from plain greedy explained
(``trimpass.diagnostics.divergence``: a near-tie or not, its gap in ulps; eagerly for Hugging Face's
routes, through its compiled body for the fused loop, as the demo does). Prints a markdown table and
writes a PNG of tokens/s against prompt length.

    python bench/lengths.py --dtype bf16
"""
from __future__ import annotations

import argparse
import itertools
import logging
import os
import statistics
import time

import numpy as np
import torch


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--prompts", type=int, default=30, help="prompts in the stream")
    ap.add_argument("--shortest", type=int, default=8, help="the shortest prompt's tokens")
    ap.add_argument("--longest", type=int, default=1024, help="the longest prompt's tokens")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="model dtype (auto: bf16 where this CPU has native bf16, else fp32)")
    ap.add_argument("--out", default="out", help="folder for lengths_<dtype>.png")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.threads < 0:
        ap.error("argument --threads: must be >= 0")
    if a.prompts < 2 or a.new_tokens < 1 or not 2 <= a.shortest < a.longest:
        ap.error("need --prompts >= 2, --new-tokens >= 1 and 2 <= --shortest < --longest")
    if a.longest - a.shortest + 1 < a.prompts:
        ap.error(f"--prompts: {a.prompts} distinct lengths do not fit in "
                 f"[{a.shortest}, {a.longest}]")
    return a


def lengths(n: int, shortest: int, longest: int) -> list[int]:
    """``n`` distinct lengths spread geometrically from ``shortest`` to ``longest``."""
    out = sorted({int(round(x)) for x in np.geomspace(shortest, longest, n)})
    extra = (x for x in range(shortest, longest) if x not in out)
    while len(out) < n:
        out = sorted([*out, next(extra)])
    return out


def prompts(tok, want: list[int]) -> list[list[int]]:
    """One prompt per length, each from its own held-out document: a chat turn cut to fit (a
    plain text prefix where the turn's wrapping alone is too long), ShareGPT first, pydoc's topics
    where ShareGPT's prompts run short."""
    from trimpass.select.corpora import held_out, held_out_chats, read
    wrap = len(tok.chat("", 0))
    docs = itertools.chain((d.prompt for d in held_out_chats("sharegpt")),
                           (d.text for d in read("pydoc") if held_out(d.doc_id)))
    pool = [(t, len(tok.encode(t, bos=False))) for t in itertools.islice(docs, 600)]
    out = []
    for n in want:
        body = n - wrap if n - wrap >= 8 else n - 1
        k = next((i for i, (_, m) in enumerate(pool) if m >= body), None)
        if k is None:
            raise SystemExit(f"no held-out document has {body} tokens for a {n}-token prompt")
        text, _ = pool.pop(k)
        ids = tok.chat(text, body) if body == n - wrap else \
            [tok.bos_id] + tok.encode(text, bos=False)[:body]
        assert len(ids) == n, (len(ids), n)
        out.append(ids)
    return out


class Route:
    def __init__(self, name, run, warm=None, compiled=False):
        """``compiled``: the route decodes through the fused loop's compiled body, whose
        divergences are explained through that body (:func:`explain_compiled`)."""
        self.name, self.run, self.warm, self.compiled = name, run, warm, compiled
        self.seconds, self.tokens, self.outs, self.per_prompt = 0.0, 0, [], []
        self.warm_s, self.warm_graphs, self.late_graphs, self.crashes = 0.0, 0, 0, 0
        self.replays = []  # a compiled route's (loop, trace) per prompt


def _routes(model, n):
    import trimpass

    def hf(**kw):
        return lambda ids: model.generate(ids, do_sample=False, max_new_tokens=n, **kw)

    draft = trimpass.self_drafter(model)
    return [
        Route("plain target (HF generate)", hf()),
        Route("fused loop (trimpass.generate)", lambda ids: trimpass.generate(model, ids, n),
              warm=lambda: trimpass.warm_up(model), compiled=True),
        Route("HF loop + trimpass.self_drafter", hf(assistant_model=draft),
              warm=lambda: trimpass.warm_up(model, draft)),
        Route("HF prompt lookup (10 tokens)", hf(prompt_lookup_num_tokens=10)),
    ]


def explain_compiled(model, stream, outs, plain_outs, n, replays):
    """The fused loop's divergences from plain greedy, each explained as the demo does, through the
    loop's compiled body: the route against plain decoding through that body (its reference,
    ``speculate=False``), the body's one-token steps against the route's own computation, replayed
    from its call's trace (``replays``); then the reference against Hugging Face's eager
    decoding, eager against the compiled body (``divergence.fused_stages``). A divergence is a
    near-tie when every stage that differs is; its gap is the worse stage's
    (``divergence.worst``)."""
    import trimpass
    from trimpass.diagnostics import divergence
    t = divergence.Tally()
    for p, out, hf, replay in zip(stream, outs, plain_outs, replays, strict=True):
        if out is p:  # a crash's output is its prompt
            continue
        if torch.equal(out, hf):
            t.same += 1
            continue
        ref = trimpass.generate(model, p, n, speculate=False)
        body = model._trimpass_fused  # the reference's loop: its compiled body's own logits
        t.record(divergence.worst(divergence.fused_stages(model, body, p.shape[1], hf, ref, out,
                                                          replay)))
    return t


def _plot(routes, lens, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for r in routes:
        ax.plot(lens, [t / s for t, s in r.per_prompt], marker="o", ms=3, label=r.name)
    ax.set_xscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("tokens/s (each prompt, compiles included)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@torch.no_grad()
def main(argv=None) -> int:
    a = _args(argv)
    import transformers

    from trimpass import dtypes
    from trimpass.diagnostics import divergence
    from trimpass.diagnostics.replay import Tracer
    from trimpass.hf import gemma as G
    from trimpass.measure import compiled_graphs
    transformers.logging.set_verbosity_error()
    if a.threads:
        torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    log = logging.getLogger("bench.lengths")
    dtype = dtypes.settle(a)
    model = G.load_model(dtype)
    tok = G.GGUFTokenizer()
    want = lengths(a.prompts + 1, a.shortest, a.longest)
    stream = [torch.tensor([p]) for p in prompts(tok, want)]
    mid = len(stream) // 2  # the warm-up prompt, outside the timed stream
    warm, stream = stream[mid], stream[:mid] + stream[mid + 1:]
    routes = _routes(model, a.new_tokens)
    for r in routes:
        log.info("warm-up: %s (one untimed call on a %d-token prompt)", r.name, warm.shape[1])
        g, t = compiled_graphs(), time.perf_counter()
        if r.warm is not None:
            r.warm()
        r.run(warm)
        r.warm_s, r.warm_graphs = time.perf_counter() - t, compiled_graphs() - g
        if r.compiled:  # each timed call's computation, to replay a divergence
            Tracer.attach(model._trimpass_fused)
    started = time.perf_counter()
    for k, p in enumerate(stream):
        for r in routes:
            g, t = compiled_graphs(), time.perf_counter()
            try:
                out = r.run(p)
            except Exception as e:  # a crash is a result: counted, and the stream goes on
                log.info("%s crashed on a %d-token prompt: %s", r.name, p.shape[1], e)
                r.crashes += 1
                out = p
            dt = time.perf_counter() - t
            r.late_graphs += compiled_graphs() - g
            n = out.shape[1] - p.shape[1]
            r.seconds, r.tokens = r.seconds + dt, r.tokens + n
            r.per_prompt.append((max(n, 1), dt))
            r.outs.append(out)
            if r.compiled:  # the loop of this very call, and its trace, to replay
                loop = model._trimpass_fused
                r.replays.append((loop, Tracer.attach(loop).trace))
        left = (time.perf_counter() - started) / (k + 1) * (len(stream) - k - 1)
        log.info("prompt %d/%d (%d tokens) done; about %.0f s left", k + 1, len(stream),
                 p.shape[1], left)
    plain = routes[0]
    lens = [p.shape[1] for p in stream]
    title = (f"Gemma-3-270M, {a.dtype}, {len(stream)} prompts of {lens[0]}-{lens[-1]} tokens x "
             f"{a.new_tokens} new, greedy, Dynamo defaults")
    print(f"\n{title}")
    print("| route | tokens/s | x plain | min x plain, prompts >= 150 tokens | warm-up s "
          "(graphs) | graphs after warm-up | crashes | = plain greedy | divergences: "
          "near-tie / not (gap in ulps) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in routes:
        ratios = [(rt / rs) / (pt / ps) for (pt, ps), (rt, rs), n in
                  zip(plain.per_prompt, r.per_prompt, lens, strict=True) if n >= 150]
        if r.compiled:
            t = explain_compiled(model, stream, r.outs, plain.outs, a.new_tokens, r.replays)
        else:
            t = divergence.Tally()
            for p, o, ref in zip(stream, r.outs, plain.outs, strict=True):
                if o is not p:  # a crash's output is its prompt
                    t.add(model, p.shape[1], ref, o)
        print(f"| {r.name} | {r.tokens / r.seconds:.2f} | "
              f"x{(r.tokens / r.seconds) / (plain.tokens / plain.seconds):.2f} | "
              f"x{min(ratios):.2f} (median x{statistics.median(ratios):.2f}) | "
              f"{r.warm_s:.1f} ({r.warm_graphs}) | {r.late_graphs} | {r.crashes} | "
              f"{t.same}/{len(stream)} | {t.cell()} |")
    print("\nper prompt, seconds: | tokens | " + " | ".join(r.name for r in routes) + " |")
    for k, n in enumerate(lens):
        print(f"| {n} | " + " | ".join(f"{r.per_prompt[k][1]:.1f}" for r in routes) + " |")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"lengths_{a.dtype}.png")
    _plot(routes, lens, path, title)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
