"""Draft trees against chains, and trimpass sampling against the free sampling peers, by category,
side by side in one run: the real Gemma-3-270M on the suffix-index bench's category sets
(``bench/suffix_categories.py``: 8 categories, held out of training and tuning).

* ``greedy``: ``trimpass.generate`` at its defaults (free drafts verified as one tree) against the
  same loop with chains (``tree=False``: the better priced chain), each on every prompt in turn;
  every tree output is checked equal to the chain output (both the loop's plain greedy decoding:
  ``tests/hf/test_tree_generate.py``).
* ``sampled`` (T = 0.7, no top-k/top-p in any route; each route seeded alike per call, ``--seeds``
  calls per prompt): the plain target sampling (Hugging Face ``generate``), Hugging Face prompt
  lookup sampling (10 tokens) and ``trimpass.generate`` at its defaults.

The suffix index's tenant is emptied between passes over the sets (one pass per seed: a prompt
never drafts from its own reply under another seed; earlier replies to other prompts stay, as in
the suffix-index bench); each route warms up on other prompts first; graphs compiled while timed
are reported.

    python bench/trees.py --dtype fp32 --runs 2 --modes greedy,sampled
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
from suffix_categories import CATEGORIES, Route, categories


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per category")
    ap.add_argument("--seeds", type=int, default=2, help="sampled calls per prompt")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--prompt-tokens", type=int, default=320, help="prompt length cap")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="fp32")
    ap.add_argument("--runs", type=int, default=2, help="passes over every set")
    ap.add_argument("--modes", default="greedy,sampled", help="which to run")
    return ap.parse_args(argv)


def greedy_routes(model, n: int) -> list:
    import trimpass

    def reset():
        trimpass.forget(model)
    return [Route("trimpass.generate, chains (tree=False)",
                  lambda ids: trimpass.generate(model, ids, n, tree=False), reset),
            Route("chains sized by cost (trees without branches, diagnostic)",
                  lambda ids: _unbranched(lambda: trimpass.generate(model, ids, n, tree={
                      "size": 15, "depth": 14})), reset),  # its own loop and records
            Route("trimpass.generate, trees (defaults)",
                  lambda ids: trimpass.generate(model, ids, n), reset)]


def _unbranched(call):
    """``call`` with every tree cut to its main path (the better source's alone): what pricing
    the verified prefix by the passes' measured costs gives without any branch."""
    from trimpass.spec.proposers.suffix import SuffixProposer
    from trimpass.spec.tree import DraftTree
    tree, merged = SuffixProposer.tree, DraftTree.merged
    SuffixProposer.tree = lambda self, *a: DraftTree.chain(tree(self, *a).main())
    DraftTree.merged = lambda a, b: a if a.values[:1] >= b.values[:1] else b
    try:
        return call()
    finally:
        SuffixProposer.tree, DraftTree.merged = tree, merged


def sampled_routes(model, n: int, t: float) -> list:
    import trimpass
    hf = dict(max_new_tokens=n, do_sample=True, temperature=t, top_k=0, top_p=1.0)
    return [Route("plain target sampling (HF generate)",
                  lambda ids: model.generate(ids, **hf), lambda: None),
            Route("HF prompt lookup sampling (10 tokens)",
                  lambda ids: model.generate(ids, prompt_lookup_num_tokens=10, **hf),
                  lambda: None),
            Route("trimpass.generate sampling (defaults)",
                  lambda ids: trimpass.generate(model, ids, n, do_sample=True, temperature=t),
                  lambda: trimpass.forget(model))]


def timed(rs, s: str, ids: torch.Tensor, seed: int | None) -> None:
    """Every route on ``ids`` in turn (each seeded alike where ``seed``); greedy outputs checked
    against the first route's."""
    from trimpass.measure import compiled_graphs
    first = None
    for r in rs:
        if seed is not None:
            torch.manual_seed(seed)
        graphs, t = compiled_graphs(), time.perf_counter()
        out = r.run(ids)[0, ids.shape[1]:].tolist()
        dt = time.perf_counter() - t
        first = out if first is None else first
        r.add(s, dt, len(out), seed is not None or out == first, compiled_graphs() - graphs)


def report(rs, title: str, sampled: bool) -> None:
    base, others = rs[0], rs[1:]
    print(f"\n### {title}\n")
    print("| set | calls | " + " | ".join(r.name for r in rs) + " | " +
          (f"{others[-1].name.split(' ')[0]} / {others[0].name.split(' (')[0]} |" if sampled
           else "trees / chains |"))
    print("|---|---:|" + "---:|" * (len(rs) + 1))
    total = {r.name: [0.0, 0] for r in rs}
    for s in (c for c in CATEGORIES if c in base.seconds):
        rate = {r.name: r.tokens[s] / r.seconds[s] for r in rs}
        for r in rs:
            total[r.name][0] += r.seconds[s]
            total[r.name][1] += r.tokens[s]
        cells = [f"{rate[base.name]:.1f} tok/s"]
        for r in others:
            same = "" if sampled else f", {r.same[s]}/{r.count[s]} same"
            g = f", {r.graphs[s]} graphs" if r.graphs[s] else ""
            cells.append(f"x{rate[r.name] / rate[base.name]:.2f}{same}{g}")
        vs = rate[rs[-1].name] / rate[rs[-2 if sampled else 0].name]
        print(f"| {s} | {base.count[s]} | " + " | ".join(cells) + f" | x{vs:.2f} |")
    over = {n: v[1] / v[0] for n, v in total.items()}
    cells = [f"{over[base.name]:.1f} tok/s"] + [f"x{over[r.name] / over[base.name]:.2f}"
                                                for r in others]
    print("| **overall** | | " + " | ".join(cells) +
          f" | **x{over[rs[-1].name] / over[rs[-2 if sampled else 0].name]:.2f}** |", flush=True)


@torch.no_grad()
def main(argv=None) -> int:
    a = _args(argv)
    import transformers

    import trimpass
    from trimpass import dtypes
    from trimpass.hf import gemma as G
    transformers.logging.set_verbosity_error()
    dtype = dtypes.settle(a)
    model = G.load_model(dtype)
    sets = categories(G.GGUFTokenizer(), a.prompts, a.prompt_tokens)
    modes = a.modes.split(",")
    built = {"greedy": greedy_routes(model, a.new_tokens),
             "sampled": sampled_routes(model, a.new_tokens, a.temperature)}
    for mode in modes:
        for r in built[mode]:
            for i, p in enumerate(sets["warm"][:2]):
                torch.manual_seed(i)
                r.run(torch.tensor([p]))
    cpu = platform.processor() or platform.machine()
    for run in range(a.runs):
        for mode in modes:
            rs = [Route(r.name, r.run, r.reset) for r in built[mode]]
            for seed in range(a.seeds) if mode == "sampled" else [None]:
                for r in rs:  # a pass over the sets: no prompt drafts from its own earlier reply
                    r.reset()
                for s in CATEGORIES:
                    for i, p in enumerate(sets[s]):
                        timed(rs, s, torch.tensor([p]), None if seed is None else 1000 * i + seed)
            t = f", T = {a.temperature}, {a.seeds} seeds a prompt" if mode == "sampled" else ""
            report(rs, f"Run {run + 1}, {mode}: tokens/s against the first route ({dtype}, "
                   f"{a.new_tokens} tokens{t}, {cpu})", mode == "sampled")
            if mode == "greedy":
                print("trees' loop:", {k: v for k, v in trimpass.stats(model).items()
                                       if k in ("tree_rounds", "branch_kept", "rounds")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
