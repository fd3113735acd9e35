"""How often the dynamically trimmed real Gemma-3-270M drafter picks the full-vocabulary greedy token.

For each ShareGPT prompt the full model generates greedily (the reference); then the drafter,
compiled with trimpass in the dynamic mode, is driven teacher-forced along that continuation with its
own KV cache — the real compiled graph and its real state ops — and its argmax is compared with the
full model's at every step. Variants: the context alone, plus the periodic full-vocabulary refresh,
plus ``observe`` fed the target's top-3 of already-verified positions. Static top-K lists (from a
Gemma-tokenized count of held-out ShareGPT assistant turns) are scored on the same steps.

    python bench/dynamic_gemma.py --prompts 20 --steps 64 --out out/
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

import trimpass
from trimpass.progress import progress
from trimpass.select.corpora import held_out, read
from trimpass.spec import gemma

VARIANTS = {
    "context": dict(refresh_every=0),
    "context+refresh64": dict(refresh_every=64, refresh_topk=128),
    "context+refresh16": dict(refresh_every=16, refresh_topk=64),
    "context+core1k": dict(refresh_every=0, core="top1k"),
    "context+core1k+refresh64": dict(refresh_every=64, refresh_topk=128, core="top1k"),
    "context+observe3": dict(refresh_every=0, observe=3),
    "context+core1k+observe3": dict(refresh_every=0, observe=3, core="top1k"),
}


def prompts(tok, n: int, max_tokens: int) -> list[list[int]]:
    out = []
    for d in read("sharegpt"):
        if held_out(d.doc_id) and 16 <= len(d.prompt) <= 4000:
            ids = tok.encode(d.prompt)[:max_tokens]
            if len(ids) < 32:
                continue
            out.append(ids)
            if len(out) == n:
                break
    return out


def static_lists(tok, V: int, docs: int = 3000) -> np.ndarray:
    counts = np.zeros(V, dtype=np.int64)
    for k, d in enumerate(read("sharegpt")):
        if k >= docs * 3:
            break
        if not held_out(d.doc_id):
            np.add.at(counts, tok.encode(d.text[:4000], bos=False), 1)
    return np.argsort(-counts, kind="stable")


def reference(model, ids, steps):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=steps,
                             min_new_tokens=steps, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):], torch.stack(out.scores)[:, 0]  # [steps], [steps, V]


def drive(model, cfg, ids, seq, scores, observe: int):
    from transformers import DynamicCache
    torch._dynamo.reset()
    be = trimpass.backend(**cfg)
    cm = torch.compile(model, backend=be)
    cache = DynamicCache(config=model.config)
    agree, active = [], []
    with torch.no_grad():
        x = torch.tensor([ids])
        pos = torch.arange(len(ids))[None]
        for i in range(len(seq)):
            if observe and i > 0:
                trimpass.observe(cm, scores[i - 1][None], observe)
            logits = cm(input_ids=x, position_ids=pos, past_key_values=cache,
                        use_cache=True).logits[0, -1]
            agree.append(int(logits.argmax()) == int(seq[i]))
            active.append(be.state.stats()["batch1"]["active"][0])
            x = seq[i].view(1, 1)
            pos = pos[:, -1:] + 1
    return agree, active


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = gemma.load_model(), gemma.GGUFTokenizer()
    V = model.config.vocab_size
    ps = prompts(tok, a.prompts, a.prompt_tokens)
    refs = [reference(model, p, a.steps) for p in progress(ps, desc="reference")]
    rank = static_lists(tok, V)
    res = {}
    for K in (1000, 3000, 8000, 16000, 32000, 64000):
        keep = torch.from_numpy(rank[:K])
        hits = [int(keep[sc[i, keep].argmax()]) == int(seq[i])
                for seq, sc in refs for i in range(len(seq))]
        res[f"static top-{K // 1000}k"] = dict(agree=float(np.mean(hits)), active=K)
    for name in a.variants:
        cfg = dict(VARIANTS[name])
        obs = cfg.pop("observe", 0)
        if cfg.get("core") == "top1k":
            cfg["core"] = torch.from_numpy(rank[:1000])
        t0 = time.time()
        agree, active = [], []
        for p, (seq, sc) in progress(list(zip(ps, refs)), desc=name):
            g, s = drive(model, dict(cfg, inner="aot_eager"), p, seq, sc, obs)
            agree += g
            active += s
        every = cfg.get("refresh_every", 0)
        amortized = float(np.mean(active)) + (V / every if every else 0.0)
        res[name] = dict(agree=float(np.mean(agree)), active=float(np.mean(active)),
                         head_rows_per_step=amortized, seconds=time.time() - t0)
        print(f"{name}: {res[name]}", flush=True)
    print(f"| set ({len(ps)} prompts x {a.steps} steps) | greedy agreement | mean active ids | "
          "head rows read per step (with refresh) |")
    print("|---|---|---|---|")
    for k, r in res.items():
        print(f"| {k} | {100 * r['agree']:.1f}% | {r['active']:,.0f} | "
              f"{r.get('head_rows_per_step', r['active']):,.0f} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "dynamic_gemma.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
