"""How often the dynamically trimmed real Gemma-3-270M picks the full-vocabulary greedy token.

Each held-out ShareGPT prompt is put in Gemma's turn format. ``--stream generated`` (default): the
full model answers greedily (the reference); ``--stream assistant``: the real assistant reply is the
stream and one full-model pass over it gives the reference logits. The model compiled with trimpass
in the dynamic mode is then driven teacher-forced along the stream with its own KV cache — the real
compiled graph and its real state ops, compiled once per variant, each prompt starting at position
0 (the automatic reset) — and at every step its argmax is compared with the full model's
(agreement), and the next token is looked up in the active set the head just read (coverage).
Variants: the context alone, plus a core list, plus the periodic full-vocabulary refresh, plus
``observe`` fed the target's top-3 at already-verified positions. Static top-K lists (from a
Gemma-tokenized count of other ShareGPT assistant turns) are scored on the same steps.

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
from trimpass.hf import gemma
from trimpass.progress import progress
from trimpass.select.corpora import held_out, held_out_chats, read

VARIANTS = {
    "context": dict(learn_core=0),
    "zero-config: context+learned1k": dict(),
    "context+learned1k+successors4": dict(successors=4),
    "context+learned2k+successors4": dict(learn_core=2048, successors=4),
    "context+core1k": dict(learn_core=0, core="top1k"),
    "context+refresh16": dict(learn_core=0, refresh_every=16, refresh_topk=64),
    "context+observe3": dict(learn_core=0, observe=3),
    "zero-config+observe3": dict(observe=3),
}


def prompts(tok, n: int, max_tokens: int, steps: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids in the turn format, the real reply's ids) for ``n`` held-out conversations."""
    out = []
    for d in held_out_chats():
        reply = tok.encode(d.text[:8000], bos=False)
        if len(reply) >= steps:
            out.append((tok.chat(d.prompt, max_tokens), reply[:steps]))
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


def reference(model, ids, reply, stream: str):
    """The stream ``seq[steps]`` and the full model's logits predicting each of its tokens."""
    steps = len(reply)
    if stream == "generated":
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=steps,
                             min_new_tokens=steps, output_scores=True, return_dict_in_generate=True)
        return out.sequences[0, len(ids):], torch.stack(out.scores)[:, 0]  # [steps], [steps, V]
    logits = model(torch.tensor([ids + reply])).logits[0]
    return torch.tensor(reply), logits[len(ids) - 1:len(ids) - 1 + steps]


def drive(cm, model, ids, seq, scores, observe: int):
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    agree, covered, active = [], [], []
    x = torch.tensor([ids])
    pos = torch.arange(len(ids))[None]  # starts at 0: the state resets itself for this request
    for i in range(len(seq)):
        if observe and i > 0:
            trimpass.observe(cm, scores[i - 1][None], observe)
        logits = cm(input_ids=x, position_ids=pos, past_key_values=cache,
                    use_cache=True).logits[0, -1]
        ids_now, n = trimpass.active_ids(cm)[0], trimpass.stats(cm)["active"][0]
        agree.append(int(logits.argmax()) == int(scores[i].argmax()))
        covered.append(bool((ids_now[:n] == seq[i]).any()))  # in the set the head just read
        active.append(n)
        x = seq[i].view(1, 1)
        pos = pos[:, -1:] + 1
    return agree, covered, active


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--stream", choices=["generated", "assistant"], default="generated")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    import transformers
    transformers.logging.set_verbosity_error()
    model, tok = gemma.load_model(), gemma.GGUFTokenizer()
    V = model.config.vocab_size
    ps = prompts(tok, a.prompts, a.prompt_tokens, a.steps)
    refs = [reference(model, p, r, a.stream) for p, r in progress(ps, desc="reference")]
    ps = [p for p, _ in ps]
    rank = static_lists(tok, V)
    res = {}
    for K in (1000, 3000, 8000, 16000, 32000, 64000):
        keep = torch.from_numpy(rank[:K])
        inside = torch.zeros(V, dtype=torch.bool)
        inside[keep] = True
        hits = [int(keep[sc[i, keep].argmax()]) == int(sc[i].argmax())
                for seq, sc in refs for i in range(len(seq))]
        cov = torch.cat([inside[seq] for seq, _ in refs]).float().mean()
        res[f"static top-{K // 1000}k"] = dict(agree=float(np.mean(hits)), coverage=float(cov),
                                               active=K)
    for name in a.variants:
        cfg = dict(VARIANTS[name])
        obs = cfg.pop("observe", 0)
        if cfg.get("core") == "top1k":
            cfg["core"] = torch.from_numpy(rank[:1000])
        t0 = time.time()
        torch._dynamo.reset()
        be = trimpass.backend(**cfg, inner="aot_eager")
        cm = torch.compile(model, backend=be)
        agree, covered, active = [], [], []
        for p, (seq, sc) in progress(list(zip(ps, refs, strict=True)), desc=name):
            g, c, s = drive(cm, model, p, seq, sc, obs)
            agree, covered, active = agree + g, covered + c, active + s
        every = cfg.get("refresh_every", 0)
        amortized = float(np.mean(active)) + (V / every if every else 0.0)
        res[name] = dict(agree=float(np.mean(agree)), coverage=float(np.mean(covered)),
                         active=float(np.mean(active)), head_rows_per_step=amortized,
                         seconds=time.time() - t0)
        print(f"{name}: {res[name]}", flush=True)
    print(f"| set ({len(ps)} prompts x {a.steps} {a.stream} steps) | greedy agreement | "
          "next-token coverage | mean active ids | head rows read per step (with refresh) |")
    print("|---|---|---|---|---|")
    for k, r in res.items():
        print(f"| {k} | {100 * r['agree']:.1f}% | {100 * r['coverage']:.1f}% | "
              f"{r['active']:,.0f} | {r.get('head_rows_per_step', r['active']):,.0f} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"dynamic_gemma_{a.stream}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
