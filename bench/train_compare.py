"""Compare trained Gemma-3-270M drafters (issue: training for acceptance length).

For each ``--drafter NAME=WEIGHTS`` (``NAME=none``: the untrained truncation), on held-out ShareGPT:
E[L] from the formulas (greedy and T=1, gamma tokens per window) over held-out text, the real greedy
MAT in Hugging Face assisted generation with the real target (fixed gamma, trimmed zero-config
unless ``--untrimmed``; ``--feedback K`` pairs the target with it, ``trimpass.pair``), lossless
against the target alone (in bf16 the target verifies row-invariantly, ``trimpass.hf.exact``),
and the acceptance rate through HF's sampling path at T=1; paired bootstrap 95% intervals over
prompts against the first drafter.
Writes a markdown table to stdout and ``--out`` (JSON).

    .venv/bin/python bench/train_compare.py --drafter kl=runs/kl/drafter.safetensors \\
        --drafter eal=runs/eal/drafter.safetensors --prompts 20 --new-tokens 64
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", action="append", required=True, metavar="NAME=WEIGHTS")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--layers", type=int, default=2, help="drafter's decoder layers (18: the "
                   "target drafting for itself)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--heldout-tokens", type=int, default=8192, help="text for E[L]")
    p.add_argument("--untrimmed", action="store_true", help="run the drafters untrimmed")
    p.add_argument("--no-sampling", action="store_true", help="skip the T=1 runs")
    p.add_argument("--feedback", type=int, default=0, metavar="K",
                   help="pair the target with each trimmed drafter (trimpass.pair): its top-K "
                   "at every position it computes join the drafter's row (default: off)")
    p.add_argument("--out", default="out/train_compare.json")
    a = p.parse_args(argv)
    pairs = [d.split("=", 1) for d in a.drafter]
    for name, path in pairs:
        if path != "none" and not os.path.isfile(path):
            p.error(f"--drafter {name}={path}: no such file")

    import transformers

    import trimpass
    from trimpass.hf import assisted, exact
    from trimpass.hf import gemma as G
    from trimpass.models import drafter_beside
    from trimpass.select.corpora import held_out_prompts
    from trimpass.train.cache import build_cache
    from trimpass.train.compare import expected_lengths, paired_bootstrap, per_prompt
    from trimpass.train.data import heldout_sequences
    transformers.logging.set_verbosity_error()
    torch.set_grad_enabled(False)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    model, tok = G.load_model(dtype), G.GGUFTokenizer()
    prompts = held_out_prompts(tok, a.prompts, a.prompt_tokens)
    text = heldout_sequences(tok, tokens=a.heldout_tokens, eos=G.END_TURN)
    cache = build_cache(model, text, model_key=f"gemma3-270m-q4_k_m/{a.dtype}/heldout", k=32)
    if dtype == torch.bfloat16:  # verification bit for bit the target's own decoding
        exact.use(model)
    _, refs = assisted.run(model, None, prompts, a.new_tokens, "target alone")
    rows = []
    for name, path in pairs:
        base = drafter_beside(model, a.layers, None if path == "none" else path)
        el = expected_lengths(G.truncated(base, a.layers), cache, a.gamma)
        torch._dynamo.reset()
        draft = G.truncated(base, a.layers)
        g = draft.generation_config
        g.num_assistant_tokens, g.num_assistant_tokens_schedule = a.gamma, "constant"
        g.assistant_confidence_threshold = 0.0
        tap = None
        if a.untrimmed:
            assisted.compile_drafter(draft, "aot_eager")
        else:
            trimpass.trim(draft, inner="aot_eager")
            tap = trimpass.pair(model, draft, k=a.feedback) if a.feedback else None
        assisted.warm_up(model, draft, prompts)
        greedy, tot = per_prompt(model, draft, prompts, a.new_tokens, name, references=refs)
        samp = [] if a.no_sampling else per_prompt(model, draft, prompts, a.new_tokens, name,
                                                    temperature=1.0)[0]
        if tap is not None:
            tap.remove()
        rows.append(dict(name=name, weights=path, el_greedy=el["greedy"],
                         el_sampling=el["sampling"], mat=[m for m, _, _ in greedy],
                         accept_t1=[x for _, x, _ in samp], lossless=tot.lossless,
                         draft_ms=tot.draft_ms, tokens_per_s=tot.tokens_per_s))
        print(f"{name}: E[L] greedy {el['greedy']:.3f} T=1 {el['sampling']:.3f}; MAT "
              f"{sum(rows[-1]['mat']) / len(prompts):.3f}", file=sys.stderr)
    first = rows[0]
    mode = "untrimmed" if a.untrimmed else "trimmed zero-config" + (
        f" + target feedback k={a.feedback}" if a.feedback else "")
    print(f"\n{len(prompts)} held-out prompts x {a.new_tokens} tokens, gamma={a.gamma}, {a.dtype}, "
          f"{mode}; E[L] over "
          f"{cache.ids.numel():,} held-out tokens; [95% paired bootstrap CI vs {first['name']}]")
    print("\n| drafter | E[L] greedy | E[L] T=1 | greedy MAT | Δ MAT | acceptance T=1 | "
          "Δ acceptance | lossless | draft ms/call |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mat = sum(r["mat"]) / len(r["mat"])
        acc = sum(r["accept_t1"]) / max(len(r["accept_t1"]), 1)
        dm = da = "-"
        if r is not first:
            m, lo, hi = paired_bootstrap(first["mat"], r["mat"])
            dm = f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            if r["accept_t1"]:
                m, lo, hi = paired_bootstrap(first["accept_t1"], r["accept_t1"])
                da = f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]"
        print(f"| {r['name']} | {r['el_greedy']:.3f} | {r['el_sampling']:.3f} | {mat:.3f} | {dm} "
              f"| {acc:.3f} | {da} | {'✓' if r['lossless'] else '✗'} | {r['draft_ms']:.2f} |")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
