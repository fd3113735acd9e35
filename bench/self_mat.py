"""The trimmed self-draft's mean accepted length against the untrimmed one: the real Gemma-3-270M
drafting for itself in the fused loop with lookup off (``trimpass.generate(lookup=False)``),
trimmed (its default dynamic active set) and untrimmed (every id live: ``vocab`` = the whole
vocabulary), in turn on each held-out ShareGPT chat prompt (``bench/hybrid.py``'s chat set),
greedy. Prints per prompt and in all: tokens emitted per verification (MAT) of each, their ratio,
the trimmed head's live ids and whether the two outputs are the same (greedy: they must be).

    python bench/self_mat.py --prompts 8 --gamma 8 --confidence 0.4
"""
from __future__ import annotations

import argparse
import logging

import torch


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="held-out chat prompts")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--prompt-tokens", type=int, default=320, help="prompt length cap")
    ap.add_argument("--gamma", type=int, default=8, help="most tokens drafted a round")
    ap.add_argument("--confidence", type=float, default=0.4,
                    help="stop drafting below this confidence (0: always gamma)")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="model dtype (auto: bf16 where this CPU has native bf16, else fp32)")
    a = ap.parse_args(argv)
    for name in ("prompts", "new_tokens", "prompt_tokens", "gamma"):
        if getattr(a, name) < 1:
            ap.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    if not 0 <= a.confidence < 1:
        ap.error("argument --confidence: must be in [0, 1)")
    return a


@torch.no_grad()
def main(argv=None) -> int:
    a = _args(argv)
    import hybrid
    import transformers

    import trimpass
    from trimpass import dtypes
    from trimpass.hf import gemma as G
    transformers.logging.set_verbosity_error()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = G.load_model(dtypes.settle(a))
    sets = hybrid.prompt_sets(G.GGUFTokenizer(), a.prompts, a.prompt_tokens)
    V = model.get_output_embeddings().weight.shape[0]
    kw = dict(lookup=False, gamma=a.gamma, confidence=a.confidence)
    rows = {"trimmed": {}, "untrimmed": dict(vocab=torch.arange(V))}
    seen = {}  # row -> (emitted, verifications) of its loop after its last call

    def counts():
        st = model._trimpass_fused.stats
        return st.emitted, st.verifications

    for name, extra in rows.items():  # compile each row's loop on the warm-up prompt
        trimpass.generate(model, torch.tensor(sets["warm"]), 32, **kw, **extra)
        seen[name] = counts()
    total = {name: [0, 0] for name in rows}
    live, same = [], 0
    print("| prompt | tokens | MAT trimmed | MAT untrimmed | ratio | live ids | same |")
    print("|---|---|---|---|---|---|---|")
    for i, p in enumerate(sets["chat"]):
        ids, outs, mat = torch.tensor([p]), {}, {}
        for name, extra in rows.items():
            outs[name] = trimpass.generate(model, ids, a.new_tokens, **kw, **extra)
            now = counts()
            d = [x - y for x, y in zip(now, seen[name], strict=True)]
            seen[name] = now
            total[name] = [t + x for t, x in zip(total[name], d, strict=True)]
            mat[name] = d[0] / max(d[1], 1)
            if name == "trimmed":
                live.append(trimpass.stats(model)["drafter"]["active"][0])
        eq = torch.equal(outs["trimmed"], outs["untrimmed"])
        same += eq
        print(f"| {i + 1} | {len(p)} | {mat['trimmed']:.2f} | {mat['untrimmed']:.2f} | "
              f"{mat['trimmed'] / mat['untrimmed']:.3f} | {live[-1]:,} | {eq} |")
    m = {name: e / max(v, 1) for name, (e, v) in total.items()}
    print(f"\nin all ({a.prompts} prompts x {a.new_tokens} tokens, {a.dtype}, gamma {a.gamma}, "
          f"confidence {a.confidence}): MAT trimmed {m['trimmed']:.2f}, untrimmed "
          f"{m['untrimmed']:.2f}, ratio {m['trimmed'] / m['untrimmed']:.3f}; live ids "
          f"{sum(live) / len(live):,.0f} on average; outputs the same {same}/{a.prompts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
