"""D-Cut in vLLM: tokens/s against concurrency, Gemma-3-270M target, the shipped drafter trimmed.

One command, from the main venv (it runs the engines with the vLLM venv's Python, one engine per
process, and draws the plot with the main venv's matplotlib):

    .venv/bin/python bench/dcut_vllm.py          # writes out/dcut_bench/{results.json,dcut.png}

It first writes the checkpoints if they are missing (``bench/vllm_tokens.py --prepare --prompts
64``). Then, for each concurrency (1, 4, 16, 64 requests of held-out ShareGPT prompts, ``--tokens``
greedy tokens each, bf16, eager): no speculation (its own engine, run before and after the
speculative one; the mean is the baseline), and in one engine with ``num_speculative_tokens=8``
the policies fixed gamma = 2, 4, 8, all-or-nothing and D-Cut, switched live with
``trimpass.serving.vllm.set_budget`` and run in turn at each concurrency (the machine's load drifts;
each policy sees the same drift; the cost model and the acceptance calibration carry over from one
run to the next, as in a deployment), then D-Cut alone in a fresh engine (its calibration learned
from its own drafts only). A fixed gamma = k stops drafting after k tokens, the work a
``num_speculative_tokens=k`` engine does. Printed: the table (tokens/s, each as a ratio to no
speculation; mean K verified per step; acceptance), the chosen-K distribution, and the measured
cost curve C(B, B + K) / C(B, B) the cut used.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONCURRENCY = (1, 4, 16, 64)
POLICIES = (("gamma=2", {"policy": "fixed", "gamma": 2}),
            ("gamma=4", {"policy": "fixed", "gamma": 4}),
            ("gamma=8", {"policy": "fixed", "gamma": 8}),
            ("all-or-nothing", {"policy": "all-or-nothing"}),
            ("D-Cut", {"policy": "dcut"}))


def _engine(a, spec: bool):
    from vllm import LLM

    from trimpass.serving import vllm as tv
    target, drafter = os.path.join(a.dir, "target"), os.path.join(a.dir, "drafter")
    if spec:
        args = tv.engine_args(target, drafter, 8, budget={"policy": "dcut", "measure_s": 30})
    else:
        args = {"model": target, "disable_hybrid_kv_cache_manager": True}
    return LLM(**args, skip_tokenizer_init=True, dtype=a.dtype, max_model_len=512,
               gpu_memory_utilization=a.memory, enforce_eager=True, max_num_seqs=64,
               disable_log_stats=False)


def _metrics(llm) -> dict:
    return {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}


def serve(a) -> None:
    """One engine (``--serve none|spec``), every concurrency; prints one RESULT line."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from trimpass.serving import vllm as tv
    llm = _engine(a, a.serve != "none")
    with open(os.path.join(a.dir, "prompts.json")) as f:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in json.load(f)]
    sp = SamplingParams(temperature=0, max_tokens=a.tokens, detokenize=False, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, detokenize=False),
                 use_tqdm=False)  # warm-up, and the cost model's start-up measurement
    rows = []
    for c in CONCURRENCY:
        for name, policy in {"spec": POLICIES, "none": (("none", None),),
                             "dcut": (("D-Cut, own engine", {"policy": "dcut"}),)}[a.serve]:
            if policy:
                tv.set_budget(llm, policy)
            before, st0 = _metrics(llm), tv.stats(llm)
            t = time.perf_counter()
            outs = llm.generate(prompts[:c], sp, use_tqdm=False)
            dt = time.perf_counter() - t
            after = _metrics(llm)
            row = {"policy": name, "concurrency": c, "seconds": dt,
                   "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                   "outputs": [list(o.outputs[0].token_ids) for o in outs]}
            if policy:
                d = {k: after.get(k, 0) - before.get(k, 0) for k in
                     ("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens")}
                st = tv.stats(llm)
                b = st["budget"]
                row.update(draft_s=st["propose_s"] - st0["propose_s"],
                           steps=st["proposals"] - st0["proposals"],
                           accepted=d["vllm:spec_decode_num_accepted_tokens"],
                           verified=d["vllm:spec_decode_num_draft_tokens"], kept=b["kept"],
                           depth=b["depth"], table=b["table"])
            rows.append(row)
            print(f"{name} c={c}: {row['tokens'] / dt:.1f} tokens/s", file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(rows), flush=True)


def _run_engine(a, which: str) -> list[dict]:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    lib = os.path.join(ROOT, ".venv-vllm", "lib", "libiomp5.so")
    if os.path.exists(lib):
        env["LD_PRELOAD"] = lib
    cmd = [a.vllm_python, __file__, "--serve", which, "--dir", a.dir, "--tokens", str(a.tokens),
           "--dtype", a.dtype, "--memory", str(a.memory)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode or not lines:
        sys.exit(f"{which}: failed\n{r.stderr[-5000:]}")
    return json.loads(lines[-1][7:])


def _mean_k(kept: dict) -> float:
    n = sum(kept.values())
    return sum(int(k) * v for k, v in kept.items()) / max(n, 1)


def report(rows: list[dict], out_png: str) -> None:
    base = {}
    for r in rows:
        if r["policy"] == "none":
            base.setdefault(r["concurrency"], []).append(r["tokens"] / r["seconds"])
    base = {c: sum(v) / len(v) for c, v in base.items()}
    ref = {r["concurrency"]: r["outputs"] for r in rows if r["policy"] == "none"}
    print("| policy | " + " | ".join(f"c = {c}" for c in CONCURRENCY) + " |")
    print("|---|" + "---|" * len(CONCURRENCY))
    print("| no speculation (tokens/s) | " + " | ".join(f"{base[c]:.1f}" for c in CONCURRENCY)
          + " |")
    spec = [r for r in rows if r["policy"] != "none"]
    names = [n for n, _ in POLICIES] + ["D-Cut, own engine"]
    for name in names:
        cells = []
        for c in CONCURRENCY:
            r = next(x for x in spec if x["policy"] == name and x["concurrency"] == c)
            tps = r["tokens"] / r["seconds"]
            acc = r["accepted"] / max(r["verified"], 1)
            same = "" if r["outputs"] == ref[c] else " ✗lossless"
            ms = 1e3 * r["draft_s"] / max(r["steps"], 1)
            cells.append(f"{tps:.1f} (x{tps / base[c]:.2f}; K {_mean_k(r['kept']):.1f}, "
                         f"acc {acc:.2f}, draft {ms:.0f} ms){same}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name in ("D-Cut", "D-Cut, own engine"):
        print(f"\nChosen K per step ({name}): ")
        for c in CONCURRENCY:
            r = next(x for x in spec if x["policy"] == name and x["concurrency"] == c)
            hist = sorted((int(k), v) for k, v in r["kept"].items())
            depth = sorted((int(k), v) for k, v in r["depth"].items())
            print(f"  c={c}: K {hist}; drafting depth {depth}")
    table = spec[-1]["table"]
    print("\nMeasured verification cost C(B, B + K) / C(B, B) (the cut's cost model, end of run):")
    from trimpass.spec.control import CostTable
    t = CostTable.from_dict(table)
    for b in (1, 4, 16, 64):
        ks = [0, b, 2 * b, 4 * b, 8 * b]
        print(f"  B={b}: " + ", ".join(f"K={k}: {t(b, b + k) / t(b, b):.2f}" for k in ks))
    _plot(base, spec, t, out_png)


def _plot(base, spec, table, out_png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax.plot(CONCURRENCY, [1.0] * len(CONCURRENCY), "k--", label="no speculation")
    for name in [n for n, _ in POLICIES] + ["D-Cut, own engine"]:
        ys = [next(r["tokens"] / r["seconds"] for r in spec if r["policy"] == name
                   and r["concurrency"] == c) / base[c] for c in CONCURRENCY]
        ax.plot(CONCURRENCY, ys, "o-" if name != "D-Cut, own engine" else "x:", label=name,
                lw=2.5 if name == "D-Cut" else 1.2)
    ax.set(xscale="log", xlabel="concurrent requests", ylabel="tokens/s vs no speculation",
           title="Gemma-3-270M in vLLM (CPU), trimmed 2-layer drafter")
    ax.set_xticks(CONCURRENCY, [str(c) for c in CONCURRENCY])
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=8, loc="lower left")
    for b in (1, 4, 16, 64):
        ks = list(range(0, 8 * b + 1, max(b // 4, 1)))
        ax2.plot([k / b for k in ks], [table(b, b + k) / table(b, b) for k in ks],
                 label=f"B = {b}")
    ax2.set(xlabel="drafted tokens verified per request (K / B)",
            ylabel="C(B, B + K) / C(B, B)", title="measured verification cost (fit)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    print(f"\nwrote {out_png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="out/dcut_bench", help="checkpoints, prompts and results")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="auto: bfloat16 where this CPU has native bf16, else float32")
    p.add_argument("--memory", type=float, default=0.3, help="vLLM's gpu_memory_utilization")
    p.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"),
                   help="the Python of the venv with trimpass[vllm]")
    p.add_argument("--serve", choices=("none", "spec", "dcut"), help=argparse.SUPPRESS)
    p.add_argument("--report", action="store_true", help="only redraw from results.json")
    a = p.parse_args()
    if a.serve:
        return serve(a)
    results = os.path.join(a.dir, "results.json")
    if not a.report:
        from trimpass import dtypes
        dtypes.settle(a, spelled=("bfloat16", "float32"))
        if not os.path.exists(os.path.join(a.dir, "prompts.json")):
            subprocess.run([sys.executable, os.path.join(HERE, "vllm_tokens.py"), "--prepare",
                            "--dir", a.dir, "--prompts", "64"], check=True)
        rows = (_run_engine(a, "none") + _run_engine(a, "spec") + _run_engine(a, "dcut")
                + _run_engine(a, "none"))
        with open(results, "w") as f:
            json.dump(rows, f)
    with open(results) as f:
        report(json.load(f), os.path.join(a.dir, "dcut.png"))


if __name__ == "__main__":
    main()
