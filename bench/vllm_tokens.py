"""vLLM tokens/s with Gemma-3-270M: no speculation, the untrimmed drafter, the trimmed drafter
(and an EAGLE drafter, untrimmed and trimmed, with ``--configs ...,eagle-untrimmed,eagle``).

Two steps, two venvs (vLLM's venv has no GGUF reader):

    .venv/bin/python bench/vllm_tokens.py --prepare [--drafter-weights FILE]   # checkpoints
    LD_PRELOAD=$PWD/.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python bench/vllm_tokens.py

``--prepare`` writes the real Gemma-3-270M target (``trimpass.models.gemma3_270m``) and its 2-layer
drafter (``gemma3_270m_drafter(weights=...)``: the shipped weights by default, ``none`` for the
untrained truncation) as safetensors checkpoints with ``trimpass.models.save_hf``, plus held-out
ShareGPT prompts in Gemma's turn format, under ``--dir``. The run starts one engine per
configuration (each in its own process, one at a time), generates greedily (fp32 unless
``--dtype``, eager) with 1, 4 and 16 concurrent requests (``--concurrency``) and prints tokens/s,
draft ms per proposal (the drafter's whole proposal of K tokens) and MAT (mean tokens per target
step: 1 + accepted / proposals), and a self-dcut run the budget's own timings per batch bucket.
Every configuration runs with ``disable_hybrid_kv_cache_manager=True`` (``engine_args`` sets it for
Gemma 3): vLLM 0.32's draft-model proposer needs all drafter layers in one KV-cache group, and
Gemma 3's hybrid sliding/full layout otherwise splits them ("All drafting layers should belong to
the same kv cache group").
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# eagle*: an EAGLE checkpoint (--eagle, e.g. bench/eagle_drafter.py's) on vLLM's eagle route
# self: the target drafting for itself, trimmed (on the target's KV cache: its first forward over
# each request's next token alone); self-dcut: the same with D-Cut's budget (a step where no draft
# can pay runs no drafter forward), lookup drafts off; hybrid: D-Cut's default, each request's
# lookup draft priced beside its self-draft; self-untrimmed: vLLM's own draft-model route, the
# target as its drafter
# ngram: vLLM's prompt-lookup drafter (no model), the peer with no drafter to train
WARM_PROMPTS = 8  # prompts after the timed ones that warm each engine up
CONFIGS = ("none", "untrimmed", "trimmed", "eagle-untrimmed", "eagle", "self", "self-dcut",
           "hybrid", "self-untrimmed", "ngram")


def prepare(a) -> None:
    from trimpass import models
    from trimpass.hf import gemma
    from trimpass.select.corpora import held_out_prompts
    os.makedirs(a.dir, exist_ok=True)
    models.save_hf(models.gemma3_270m(), os.path.join(a.dir, "target"))
    w = None if a.drafter_weights == "none" else a.drafter_weights
    models.save_hf(models.gemma3_270m_drafter(weights=w), os.path.join(a.dir, "drafter"))
    out = held_out_prompts(gemma.GGUFTokenizer(), a.prompts, 128)
    with open(os.path.join(a.dir, "prompts.json"), "w") as f:
        json.dump(out, f)
    print(f"wrote {a.dir}/target, drafter ({a.drafter_weights}), prompts.json")


def serve(a) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from trimpass.serving import vllm as tv
    from trimpass.spec.control import CostTable
    target, drafter = os.path.join(a.dir, "target"), os.path.join(a.dir, "drafter")
    if a.config == "none":  # the same KV-cache layout as the speculative runs
        args = {"model": target, "disable_hybrid_kv_cache_manager": True}
    elif a.config == "self":
        args = tv.engine_args(target, None, a.k)
    elif a.config == "self-untrimmed":
        args = tv.engine_args(target, None, a.k, trim=False)
    elif a.config == "self-dcut":
        args = tv.engine_args(target, None, a.k, budget={"policy": "dcut", "measure_s": 10,
                                                         "lookup": False})
    elif a.config == "hybrid":
        args = tv.engine_args(target, None, a.k, budget={"policy": "dcut", "measure_s": 10})
    elif a.config == "ngram":
        args = {"model": target, "disable_hybrid_kv_cache_manager": True, "speculative_config": {
            "method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4}}
    elif a.config.startswith("eagle"):
        args = tv.engine_args(target, a.eagle, a.k, trim=a.config == "eagle", method="eagle")
    else:
        args = tv.engine_args(target, drafter, a.k, trim=a.config == "trimmed")
    llm = LLM(**args, skip_tokenizer_init=True, dtype=a.dtype, max_model_len=512,
              gpu_memory_utilization=a.memory, enforce_eager=True,
              max_num_seqs=max(_concurrency(a)), disable_log_stats=False)
    with open(os.path.join(a.dir, "prompts.json")) as f:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in json.load(f)]
    timed = max(_concurrency(a))
    warm = prompts[timed:timed + WARM_PROMPTS]  # a user's next prompt is new: warm on others
    if not warm:
        sys.exit(f"--dir: {len(prompts)} prompts, none left to warm up on beside the {timed} "
                 f"timed; run --prepare --prompts {timed + WARM_PROMPTS}")
    wp = SamplingParams(temperature=0, max_tokens=16, detokenize=False, ignore_eos=True)
    llm.generate(warm[:1], wp, use_tqdm=False)
    llm.generate(warm, wp, use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=a.tokens, detokenize=False, ignore_eos=True)
    rows = []
    for c in [c for c in _concurrency(a) for _ in range(a.repeat)]:
        before = _counters(llm)
        t = time.perf_counter()
        outs = llm.generate(prompts[:c], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        after = _counters(llm)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        d = {k: after[k] - before[k] for k in after}
        rows.append({"config": a.config, "concurrency": c, "tokens_s": n / dt,
                     "run": 1 + sum(r["concurrency"] == c for r in rows),
                     "draft_ms": 1e3 * d["propose_s"] / max(d["proposals"], 1),
                     "mat": 1 + d["accepted"] / d["drafts"] if d["drafts"] else None,
                     "mean_active": after.get("mean_active"),
                     "skipped": d.get("skipped", 0), "probes": d.get("probes", 0),
                     "plain_probes": d.get("plain_probes", 0),
                     "plain_steps": d.get("plain_steps", 0),
                     "budget_share": d["budget_s"] / dt, "lookup_rows": d["lookup_rows"]})
    print("RESULT " + json.dumps(rows), flush=True)
    b = tv.stats(llm).get("budget")
    if b:  # the budget's own timings, per batch bucket, in ms
        ms = {k: {str(n): round(1e3 * v, 1) for n, v in b[k].items()}
              for k in ("first_s", "step_s", "overhead_s", "overhead_plain_s")}
        c = CostTable.from_dict(b["table"])
        ms["C(B,B)"] = {str(n): round(1e3 * c(n, n), 1) for n in c.batches}
        ms["C(B,2B)"] = {str(n): round(1e3 * c(n, 2 * n), 1) for n in c.batches}  # 1 draft each
        print("BUDGET " + json.dumps(ms), flush=True)


def _concurrency(a) -> list[int]:
    return [int(c) for c in a.concurrency.split(",")]


def _counters(llm) -> dict:
    from trimpass.serving import vllm as tv
    m = {x.name: getattr(x, "value", 0) for x in llm.get_metrics()}
    s = tv.stats(llm)
    b = s.get("budget", {})
    return {"skipped": b.get("skipped", 0),
            "probes": b.get("probes", 0), "plain_probes": b.get("plain_probes", 0),
            "plain_steps": s.get("plain_steps", 0),
            "accepted": m.get("vllm:spec_decode_num_accepted_tokens", 0),
            "drafts": m.get("vllm:spec_decode_num_drafts", 0), "proposals": s["proposals"],
            "propose_s": s["propose_s"], "mean_active": s["mean_active"],
            "budget_s": s.get("budget_s", 0.0), "lookup_rows": b.get("lookup_rows", 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dir", default="out/vllm_bench")
    p.add_argument("--prepare", action="store_true", help="write the checkpoints (main venv)")
    p.add_argument("--drafter-weights", default="shipped",
                   help="'shipped', a safetensors file from `trimpass train`, or 'none'")
    p.add_argument("--config", choices=CONFIGS, help="serve one configuration (internal)")
    p.add_argument("--configs", default="none,untrimmed,trimmed", help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--eagle", default="out/eagle/eagle-ckpt",
                   help="the eagle configurations' EAGLE checkpoint (bench/eagle_drafter.py's)")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts --prepare writes")
    p.add_argument("--concurrency", default="1,4,16", help="concurrent requests, in turn")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("-k", type=int, default=4, help="tokens drafted per proposal")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each concurrency in a row, a row each ('run N'): later runs "
                        "start with the costs a budget measured in earlier ones, as on a server "
                        "that has run a while")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the engine's dtype")
    p.add_argument("--memory", type=float, default=0.3,
                   help="gpu_memory_utilization: on CPU the share of RAM vLLM reserves (0.2 "
                        "leaves no KV cache once target and drafter weights are in)")
    a = p.parse_args()
    if a.repeat < 1:
        p.error("argument --repeat: must be >= 1")
    if a.prepare:
        return prepare(a)
    if a.config:
        return serve(a)
    print("| drafter | concurrency | tokens/s | draft ms/proposal | MAT | mean active ids | "
          "proposals skipped |")
    print("|---|---|---|---|---|---|---|")
    for c in a.configs.split(","):
        cmd = [sys.executable, __file__, "--config", c, "--dir", a.dir, "--tokens",
               str(a.tokens), "-k", str(a.k), "--dtype", a.dtype, "--memory", str(a.memory),
               "--eagle", a.eagle, "--concurrency", a.concurrency, "--repeat", str(a.repeat)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode or not lines:
            sys.exit(f"{c}: failed\n{r.stderr[-4000:]}")
        for line in r.stdout.splitlines():
            if line.startswith("BUDGET "):
                print(f"<!-- {c} budget, ms by batch bucket: {line[7:]} -->", file=sys.stderr)
        for row in json.loads(lines[-1][7:]):
            mat = "-" if row["mat"] is None else f"{row['mat']:.2f}"
            ms = "-" if c == "none" else f"{row['draft_ms']:.1f}"
            act = f"{row['mean_active']:.0f}" if c in ("trimmed", "eagle", "self",
                                                       "self-dcut", "hybrid") else "-"
            run = f" (run {row['run']})" if a.repeat > 1 else ""
            print(f"| {c}{run} | {row['concurrency']} | {row['tokens_s']:.2f} | {ms} | {mat} | "
                  f"{act} | {row.get('skipped', 0)} |", flush=True)


if __name__ == "__main__":
    main()
