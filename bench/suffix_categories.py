"""``trimpass.generate`` (lookup, the suffix index and trimmed self-drafts, its defaults) against
the free drafting peers, by category and on a repeated-work stream, side by side in one run: the
real Gemma-3-270M decoding greedily as the plain target (Hugging Face ``generate``), with Hugging
Face prompt lookup (10 tokens), with ArcticInference's suffix decoding at vLLM's ``suffix`` defaults
(``bench/suffix_peer.py``: tree depth 24, ``max_spec_factor`` 1.0, ``min_token_prob`` 0.1, 16
tokens; its global tree of earlier responses on), and in trimpass's loop. Every route runs on each
prompt in turn; each keeps earlier outputs across the prompts of one pass (ArcticInference its
global tree, trimpass the caller's tenant), and both are emptied between passes, so a pass never
drafts from its own earlier pass. Categories, all held out of training and tuning: ShareGPT prompts
by kind (``writing``, ``roleplay``, ``qa``, ``code``, ``math``), ``completion`` (a stdlib function's
start, to continue), ``extraction`` and ``summary`` (a ``pydoc_data.topics`` entry). The
``repeated`` stream: ShareGPT conversations of three turns each (the question, "shorter", the
question asked again), the model's replies in the history, one tenant throughout, every route on
each turn in turn. Warm-up on other prompts; graphs compiled while timed are reported; every output
is checked against plain greedy.

    python bench/suffix_categories.py --dtype fp32 --runs 2
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch

KINDS = {
    "writing": ("write", "compose", "create a story", "draft", "tell a story", "write a poem"),
    "roleplay": ("act as", "pretend", "you are a", "you are an", "roleplay", "role-play",
                 "imagine you"),
    "code": ("code", "python", "function", "javascript", "sql", "java ", "c++", "script"),
    "math": ("calculate", "solve", "equation", "how many", "what is the sum", "percent", "math"),
    "qa": ("what ", "why ", "how ", "who ", "when ", "explain", "where "),
}
CATEGORIES = (*KINDS, "completion", "extraction", "summary")
FOLLOW = ("Make your answer shorter.", None)  # None: the first question, asked again


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per category")
    ap.add_argument("--conversations", type=int, default=6, help="conversations in the stream")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--prompt-tokens", type=int, default=320, help="prompt length cap")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="fp32")
    ap.add_argument("--runs", type=int, default=2, help="passes over every set")
    ap.add_argument("--sets", default="categories,repeated", help="which to run")
    a = ap.parse_args(argv)
    for name in ("prompts", "conversations", "new_tokens", "prompt_tokens", "runs"):
        if getattr(a, name) < 1:
            ap.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    return a


def kind_of(prompt: str) -> str | None:
    p = prompt.lstrip().lower()
    for kind in ("writing", "roleplay", "code", "math"):
        if any(p.startswith(w) or (kind != "writing" and w in p[:200]) for w in KINDS[kind]):
            return kind
    return "qa" if p.startswith(KINDS["qa"]) else None


def categories(tok, n: int, cap: int) -> dict[str, list[list[int]]]:
    """``n`` held-out prompts per category, and ``warm``: one more of each kind for the warm-up."""
    import pydoc_data.topics as topics

    from trimpass.select.corpora import held_out, held_out_chats, read
    found: dict[str, list[str]] = {k: [] for k in KINDS}
    for d in itertools.islice(held_out_chats("sharegpt"), 3000):
        k = kind_of(d.prompt)
        if k is not None and len(found[k]) < n + 1 and len(d.prompt) < 1500:
            found[k].append(d.prompt)
    code = [d.text for d in read("stdlib") if held_out(d.doc_id) and "\ndef " in d.text]
    starts = []
    for text in code:
        at = text.index("\ndef ")
        starts.append(text[at + 1:at + 1 + cap * 2])
        if len(starts) > n:
            break
    entries = [v for k, v in sorted(topics.topics.items()) if 1500 < len(v) < 6000]
    ask = {"completion": "Continue this Python code:\n\n{}",
           "extraction": "List every Python keyword and built-in name this text mentions, one a "
                         "line:\n\n{}",
           "summary": "Summarize this text in a few sentences:\n\n{}"}
    texts = dict(found, completion=starts, extraction=entries[::2][:n + 1],
                 summary=entries[1::2][:n + 1])
    for k in ("completion", "extraction", "summary"):
        texts[k] = [ask[k].format(t[:cap * 3]) for t in texts[k]]
    short = [k for k, v in texts.items() if len(v) < n + 1]
    if short:
        raise SystemExit(f"categories {short}: fewer than {n + 1} held-out prompts")
    sets = {k: [tok.chat(p, cap) for p in v[:n]] for k, v in texts.items()}
    sets["warm"] = [tok.chat(v[n], cap) for v in texts.values()]
    return sets


def conversations(tok, n: int, cap: int) -> list[str]:
    """``n`` held-out ShareGPT questions (not among the categories' first prompts)."""
    from trimpass.select.corpora import held_out_chats
    qa = [d.prompt for d in itertools.islice(held_out_chats("sharegpt"), 3000, 6000)
          if kind_of(d.prompt) in ("qa", "writing") and len(d.prompt) < 600]
    return qa[:n]


def turns(tok, history: list[tuple[str, list[int] | None]], cap: int) -> list[int]:
    """A chat of user turns and the model's replies (ids), ready for the next reply."""
    from trimpass.hf.gemma import END_TURN, START_TURN
    ids = [tok.bos_id]
    for text, reply in history:
        ids += [START_TURN] + tok.encode("user\n", bos=False) + tok.encode(text, bos=False)[:cap]
        ids += [END_TURN, tok.vocab["\n"], START_TURN] + tok.encode("model\n", bos=False)
        if reply is not None:
            ids += reply + [END_TURN, tok.vocab["\n"]]
    return ids


class Route:
    def __init__(self, name, run, reset):
        self.name, self.run, self.reset = name, run, reset
        self.seconds, self.tokens, self.same, self.count, self.graphs = ({} for _ in range(5))

    def add(self, s: str, dt: float, k: int, same: bool, graphs: int) -> None:
        for d, v in ((self.seconds, dt), (self.tokens, k), (self.same, int(same)),
                     (self.count, 1), (self.graphs, graphs)):
            d[s] = d.get(s, 0) + v


def routes(model, n: int):
    import suffix_peer

    import trimpass
    from trimpass.hf.fused import eos_ids
    eos, peer = eos_ids(model), {"cache": suffix_peer.cache_or_reason()}
    if isinstance(peer["cache"], str):
        raise SystemExit(f"the suffix decoding peer cannot run: {peer['cache']}")

    def arctic_reset():
        peer["cache"] = suffix_peer.cache_or_reason()

    return [
        Route("plain target (HF generate)",
              lambda ids: model.generate(ids, max_new_tokens=n, do_sample=False), lambda: None),
        Route("HF prompt lookup (10 tokens)", lambda ids: model.generate(
            ids, max_new_tokens=n, do_sample=False, prompt_lookup_num_tokens=10), lambda: None),
        Route("ArcticInference suffix decoding (global tree on)",
              lambda ids: suffix_peer.generate(model, ids, n, peer["cache"], eos), arctic_reset),
        Route("trimpass.generate (defaults, one tenant)",
              lambda ids: trimpass.generate(model, ids, n), lambda: trimpass.forget(model)),
    ]


def timed(rs, s: str, ids: torch.Tensor, outs: list | None = None) -> list:
    """Every route on ``ids`` in turn; each output checked against the plain target's."""
    from trimpass.measure import compiled_graphs
    got = []
    for r in rs:
        graphs, t = compiled_graphs(), time.perf_counter()
        out = r.run(ids)
        dt = time.perf_counter() - t
        got.append(out[0, ids.shape[1]:].tolist())
        r.add(s, dt, len(got[-1]), got[-1] == got[0], compiled_graphs() - graphs)
    return got


@torch.no_grad()
def main(argv=None) -> int:
    a = _args(argv)
    import transformers

    from trimpass import dtypes
    from trimpass.hf import gemma as G
    transformers.logging.set_verbosity_error()
    dtype = dtypes.settle(a)
    model = G.load_model(dtype)
    tok = G.GGUFTokenizer()
    sets = categories(tok, a.prompts, a.prompt_tokens)
    rs = routes(model, a.new_tokens)
    for r in rs:
        for p in sets["warm"][:2]:
            r.run(torch.tensor([p]))
    which = a.sets.split(",")
    for run in range(a.runs):
        results = routes_copy(rs)
        for r in results:
            r.reset()
        if "categories" in which:
            for s in CATEGORIES:
                for p in sets[s]:
                    timed(results, s, torch.tensor([p]))
                print(f"run {run + 1}: {s} done", flush=True)
        if "repeated" in which:
            for r in results:
                r.reset()
            stream_routes(results, tok, conversations(tok, a.conversations, a.prompt_tokens),
                          a.prompt_tokens)
        report(results, run + 1, a, dtype)
    return 0


def routes_copy(rs):
    return [Route(r.name, r.run, r.reset) for r in rs]


def stream_routes(rs, tok, questions, cap: int) -> None:
    """The repeated-work stream: each turn runs every route in turn on one history, the plain
    target's replies in it (every route's reply is checked against the plain one)."""
    for q in questions:
        history = []
        for follow in (q, *FOLLOW):
            history.append((follow if follow is not None else q, None))
            got = timed(rs, "repeated", torch.tensor([turns(tok, history, cap)]))
            history[-1] = (history[-1][0], got[0])


def report(rs, run: int, a, dtype) -> None:
    import platform
    plain, others = rs[0], rs[1:]
    sets = [s for s in (*CATEGORIES, "repeated") if s in plain.seconds]
    names = [r.name for r in others]
    print(f"\n### Run {run}: tokens/s against the plain target ({dtype}, {a.new_tokens} tokens, "
          f"{platform.processor() or platform.machine()})\n")
    print("| set | prompts | " + " | ".join(names) + " | trimpass / better peer |")
    print("|---|---:|" + "---:|" * (len(names) + 1))
    total = {r.name: [0.0, 0] for r in rs}
    for s in sets:
        rate = {}
        for r in rs:
            if s in r.seconds:
                rate[r.name] = r.tokens[s] / r.seconds[s]
                if s != "repeated":
                    total[r.name][0] += r.seconds[s]
                    total[r.name][1] += r.tokens[s]
        base = plain.tokens[s] / plain.seconds[s] if s != "repeated" else None
        cells, ratios = [], {}
        for r in others:
            if r.name not in rate:
                cells.append("-")
                continue
            ratios[r.name] = rate[r.name] / (base or plain.tokens[s] / plain.seconds[s])
            same = f"{r.same[s]}/{r.count[s]}"
            g = f", {r.graphs[s]} graphs" if r.graphs[s] else ""
            cells.append(f"x{ratios[r.name]:.2f} ({same} same{g})")
        peers = [ratios[n] for n in names[:-1] if n in ratios]
        vs = f"x{ratios[names[-1]] / max(peers):.2f}" if peers and names[-1] in ratios else "-"
        print(f"| {s} | {plain.count.get(s, 0)} | "
              + " | ".join(cells) + f" | {vs} |")
    if any(total[plain.name]):
        base = total[plain.name][1] / total[plain.name][0]
        over = {r.name: total[r.name][1] / total[r.name][0] / base for r in others
                if total[r.name][0]}
        vs = over[names[-1]] / max(over[n] for n in names[:-1])
        print("| **categories overall** | | " + " | ".join(f"x{over[n]:.2f}" for n in names)
              + f" | **x{vs:.2f}** |")


if __name__ == "__main__":
    raise SystemExit(main())
