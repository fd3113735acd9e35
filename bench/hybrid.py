"""Lookup drafts beside trimmed self-drafts (``trimpass.generate``'s default) against its peers, on
three prompt sets, side by side in one run: the real Gemma-3-270M decoding greedily as the plain
target (Hugging Face ``generate``), with Hugging Face prompt lookup, in the fused loop drafting with
its trimmed head alone (``lookup=False``), in the hybrid (lookup and trimmed self-drafts, chosen per
round), and a forced no-match control (lookup on, its proposals discarded: its overhead alone).
Sets, all held out of training: ``chat`` (ShareGPT prompts), ``copy`` (a stdlib source file to
rewrite with type hints: the reply copies its prompt), ``free`` (ShareGPT prompts asking to write,
compose or translate). Each prompt runs every row in turn. Per set and row: tokens/s against plain
and against the better of lookup and the fused loop, body passes per token, outputs equal to plain
greedy and, greedy, each divergence explained as ``bench/lengths.py`` explains it (a near-tie or
not, its gap in bf16 ulps of the top logit). Prints markdown tables and writes a PNG.

    python bench/hybrid.py --dtype bf16
"""
from __future__ import annotations

import argparse
import itertools
import logging
import os
import time

import torch

SETS = ("chat", "copy", "free")


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6, help="prompts per set")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--prompt-tokens", type=int, default=320, help="prompt length cap")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="model dtype (auto: bf16 where this CPU has native bf16, else fp32)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; above 0: every row samples at this temperature")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default="out", help="folder for hybrid_<dtype>.png")
    a = ap.parse_args(argv)
    for name in ("prompts", "new_tokens", "prompt_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    if a.temperature < 0 or a.threads < 0:
        ap.error("arguments --temperature and --threads: must be >= 0")
    return a


def prompt_sets(tok, n: int, cap: int) -> dict[str, list[list[int]]]:
    """``n`` held-out prompts per set, each a chat turn cut to ``cap`` tokens; ``warm`` holds one
    more chat prompt for the warm-up."""
    from trimpass.select.corpora import held_out, held_out_chats, read
    chats = [d.prompt for d in itertools.islice(held_out_chats("sharegpt"), 400)]
    free = [p for p in chats if p.lstrip().lower().startswith(("write", "compose", "translate",
                                                                "create a story", "tell a story"))]
    code = (d.text for d in read("stdlib") if held_out(d.doc_id) and 2000 < len(d.text) < 20000)
    copy = ["Rewrite this Python code with type hints added, and change nothing else:\n\n"
            + t[:cap * 3] for t in itertools.islice(code, n)]
    plain_chats = [p for p in chats if p not in free]
    return {"chat": [tok.chat(p, cap) for p in plain_chats[:n]],
            "copy": [tok.chat(p, cap) for p in copy],
            "free": [tok.chat(p, cap) for p in free[:n]],
            "warm": [tok.chat(plain_chats[n], cap)]}


class Row:
    def __init__(self, name, run, loop_key=None):
        self.name, self.run, self.loop_key = name, run, loop_key
        self.seconds, self.tokens, self.outs, self.passes, self.prev = {}, {}, {}, {}, None
        self.graphs = {}  # graphs compiled while timed
        self.replays = {}  # a fused row's (loop, trace) per call: its divergences, replayed


def _rows(model, n, temperature):
    import trimpass
    from trimpass.hf.fused import FusedLoop
    from trimpass.spec.drafts import Drafts
    from trimpass.spec.proposers.lookup import LookupProposer
    # the same distribution in every row: HF's generation_config may carry a top-k and a top-p
    sample = dict(do_sample=True, temperature=temperature) if temperature else dict(do_sample=False)
    hf = dict(sample, top_k=0, top_p=1.0) if temperature else sample

    class NoMatch(LookupProposer):
        def draft(self, *args, **kw):
            return Drafts.empty(len(super().draft(*args, **kw)))  # its cost, not its drafts

    def fused(**kw):
        return lambda ids: trimpass.generate(model, ids, n, **sample, **kw)

    def control(ids):  # the loop's proposer class, for this call only
        FusedLoop.proposer = NoMatch
        try:
            return trimpass.generate(model, ids, n, lookup=14, **sample)
        finally:
            FusedLoop.proposer = LookupProposer

    return [
        Row("plain target (HF generate)",
            lambda ids: model.generate(ids, max_new_tokens=n, **hf)),
        Row("HF prompt lookup (10 tokens)", lambda ids: model.generate(
            ids, max_new_tokens=n, prompt_lookup_num_tokens=10, **hf)),
        Row("fused loop, trimmed self-drafts alone (lookup=False)", fused(lookup=False), False),
        Row("fused loop, lookup + trimmed self-drafts (default)", fused(), True),
        Row("control: lookup on, proposals discarded", control, 14),
    ] + _suffix_row(model, n, temperature)


def _suffix_row(model, n, temperature):
    """ArcticInference's suffix decoding where it is installed, greedy (``bench/suffix_peer.py``);
    else the reason, printed."""
    import suffix_peer

    from trimpass.hf.fused import eos_ids
    cache = suffix_peer.cache_or_reason()
    if isinstance(cache, str) or temperature:
        print(f"suffix decoding peer not run: {cache if isinstance(cache, str) else 'greedy only'}")
        return []
    eos = eos_ids(model)
    return [Row("ArcticInference suffix decoding (its global cache on)",
                lambda ids: suffix_peer.generate(model, ids, n, cache, eos))]


@torch.no_grad()
def main(argv=None) -> int:
    a = _args(argv)
    import transformers

    from trimpass import dtypes
    from trimpass.diagnostics.replay import Tracer
    from trimpass.hf import gemma as G
    from trimpass.measure import compiled_graphs
    transformers.logging.set_verbosity_error()
    if a.threads:
        torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    log = logging.getLogger("bench.hybrid")
    dtype = dtypes.settle(a)
    model = G.load_model(dtype)
    sets = prompt_sets(G.GGUFTokenizer(), a.prompts, a.prompt_tokens)
    rows = _rows(model, a.new_tokens, a.temperature)
    for r in rows:
        log.info("warm-up: %s", r.name)
        r.run(torch.tensor(sets["warm"]))
        r.prev = model._trimpass_fused.stats.as_dict() if r.loop_key is not None else None
        if r.loop_key is not None:  # each timed call's computation, to replay a divergence
            Tracer.attach(model._trimpass_fused)
    started, total = time.perf_counter(), sum(len(sets[s]) for s in SETS)
    done = 0
    for s in SETS:
        for p in sets[s]:
            ids = torch.tensor([p])
            for i, r in enumerate(rows):
                torch.manual_seed(1000 * done + i)
                graphs, t = compiled_graphs(), time.perf_counter()
                out = r.run(ids)
                dt = time.perf_counter() - t
                r.graphs[s] = r.graphs.get(s, 0) + compiled_graphs() - graphs
                k = out.shape[1] - ids.shape[1]
                r.seconds[s] = r.seconds.get(s, 0.0) + dt
                r.tokens[s] = r.tokens.get(s, 0) + k
                r.outs.setdefault(s, []).append(out)
                if r.loop_key is not None:  # this row's own loop's counters, this call's share
                    loop = model._trimpass_fused
                    r.replays.setdefault(s, []).append((loop, Tracer.attach(loop).trace))
                    st = loop.stats.as_dict()
                    d = {key: st[key] - r.prev[key] for key in ("body_steps", "batched_passes")}
                    r.passes[s] = r.passes.get(s, 0) + d["body_steps"] + d["batched_passes"]
                    r.prev = st
            done += 1
            left = (time.perf_counter() - started) / done * (total - done)
            log.info("%s prompt done (%d/%d); about %.0f s left", s, done, total, left)
    _report(rows, a, model, sets)
    return 0


def _divergences(model, rows, a, s, prompts) -> dict:
    """Greedy: each row's outputs that differ from plain greedy, explained (``bench/lengths.py``):
    a fused row's through its compiled body, its own call replayed; any other row's against the
    model's eager logits. Row name -> ``divergence.Tally``."""
    from lengths import explain_compiled

    from trimpass.diagnostics import divergence
    plain, found = rows[0], {}
    for r in rows[1:]:
        if r.loop_key is not None:
            found[r.name] = explain_compiled(model, [torch.tensor([p]) for p in prompts],
                                             r.outs[s], plain.outs[s], a.new_tokens,
                                             r.replays[s])
        else:
            found[r.name] = t = divergence.Tally()
            for p, o, ref in zip(prompts, r.outs[s], plain.outs[s], strict=True):
                t.add(model, len(p), ref, o)
    return found


def _report(rows, a, model, sets):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plain, hf_lookup, alone = rows[0], rows[1], rows[2]
    mode = f"sampled at T = {a.temperature}" if a.temperature else "greedy"
    tag = f"{a.dtype}_t{a.temperature:g}" if a.temperature else a.dtype
    fig, axes = plt.subplots(1, len(SETS), figsize=(12, 3.6), dpi=120, sharey=True)
    for s, ax in zip(SETS, axes, strict=True):
        tps = {r.name: r.tokens[s] / r.seconds[s] for r in rows}
        best_peer = max(tps[hf_lookup.name], tps[alone.name])
        print(f"\nset {s}: Gemma-3-270M {a.dtype}, {len(plain.outs[s])} prompts x "
              f"{a.new_tokens} tokens, {mode}, {torch.get_num_threads()} threads")
        found = {} if a.temperature else _divergences(model, rows, a, s, sets[s])
        print("| row | tokens/s | x plain | x better of lookup and fused | body passes / token |"
              " graphs compiled while timed | = plain greedy | divergences: near-tie / not "
              "(gap in ulps) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            same = sum(torch.equal(x, y) for x, y in zip(r.outs[s], plain.outs[s], strict=True))
            same = "-" if a.temperature else f"{same}/{len(plain.outs[s])}"
            passes = f"{r.passes[s] / r.tokens[s]:.2f}" if r.passes.get(s) else "-"
            why = found[r.name].cell() if r.name in found else "-"
            print(f"| {r.name} | {tps[r.name]:.2f} | x{tps[r.name] / tps[plain.name]:.2f} | "
                  f"x{tps[r.name] / best_peer:.2f} | {passes} | {r.graphs[s]} | {same} | {why} |")
        ax.barh(range(len(rows)), [tps[r.name] / tps[plain.name] for r in rows],
                color=["tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:olive",
                       "tab:purple"][:len(rows)])
        ax.axvline(1.0, color="black", ls="--", lw=1)
        ax.set_title(f"{s} prompts", fontsize=9)
        ax.set_xlabel("tokens/s ÷ plain target's", fontsize=8)
    axes[0].set_yticks(range(len(rows)), [r.name for r in rows], fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle(f"Gemma-3-270M, {a.dtype}, {mode}, {a.new_tokens} new tokens", fontsize=9)
    fig.tight_layout()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"hybrid_{tag}.png")
    fig.savefig(path)
    print(f"plot: {path}")


if __name__ == "__main__":
    raise SystemExit(main())
