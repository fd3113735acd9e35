"""vLLM in steady state, Gemma-3-270M drafting for itself: tokens/s against concurrency for no
speculation, the target drafting for itself (untrimmed: vLLM's own route; trimmed; trimmed with
D-Cut; trimpass's hybrid, D-Cut pricing each request's lookup draft beside its self-draft) and
vLLM's ``ngram``, in one invocation, per dtype; a markdown table, its rows as JSON and
a PNG (drawn with ``--plot OUT`` from the main venv where vLLM's has no matplotlib).

    .venv/bin/python bench/vllm_tokens.py --prepare --prompts 72            # checkpoints, prompts
    LD_PRELOAD=$PWD/.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python bench/vllm_steady.py

Each configuration is one engine (``bench/vllm_tokens.py --config ...`` in its own process, one
after another), warmed up on 8 prompts that are not timed, then each concurrency is run
``--repeat`` times in a row on the first N held-out ShareGPT prompts, ``--tokens`` greedy tokens
each (ignoring EOS). A row's ratio is against no speculation's run of the same index at the same
concurrency; the table shows every run, the PNG the last (the steady state: the budget has timed
this batch size in the earlier ones). Progress goes to stderr and ``--log``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = {"none": "no speculation", "self-untrimmed": "self-drafting, untrimmed (vLLM's route)",
         "self": "self-drafting, trimmed", "self-dcut": "self-drafting, trimmed, D-Cut",
         "ngram": "vLLM ngram",
         "hybrid": "trimpass hybrid (lookup, suffix index + self-drafts, D-Cut)"}


def log(a, msg: str) -> None:
    line = f"[{datetime.datetime.now():%H:%M:%S}] {msg}"
    print(line, file=sys.stderr, flush=True)
    if a.log:
        with open(a.log, "a") as f:
            f.write(line + "\n")


def run_config(a, config: str, dtype: str) -> list[dict]:
    cmd = [sys.executable, os.path.join(HERE, "vllm_tokens.py"), "--config", config, "--dir",
           a.dir, "--tokens", str(a.tokens), "-k", str(a.k), "--dtype", dtype, "--memory",
           str(a.memory), "--concurrency", a.concurrency, "--repeat", str(a.repeat)]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode or not lines:
        sys.exit(f"{config} ({dtype}): failed\n{r.stderr[-4000:]}")
    rows = json.loads(lines[-1][len("RESULT "):])
    for line in r.stdout.splitlines():  # a budget's own timings, ms by batch bucket
        if line.startswith("BUDGET "):
            rows[-1]["budget_ms"] = json.loads(line[len("BUDGET "):])
    log(a, f"{dtype} {config}: " + ", ".join(f"{x['concurrency']}:{x['tokens_s']:.1f}"
                                             for x in rows) + f" tok/s "
                                                              f"({time.perf_counter() - t:.0f} s)")
    return rows


def table(rows: list[dict], dtype: str) -> list[str]:
    base = {(r["concurrency"], r["run"]): r["tokens_s"] for r in rows if r["config"] == "none"}
    out = [f"### {dtype}", "",
           "| configuration | run | tokens/s at " + " / ".join(
               str(c) for c in sorted({r["concurrency"] for r in rows})) +
           " | vs no speculation | draft ms | MAT | skipped | probes | plain probes "
           "| plain steps | lookup rows | budget's share |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for config in dict.fromkeys(r["config"] for r in rows):
        for run in sorted({r["run"] for r in rows if r["config"] == config}):
            got = sorted((r for r in rows if r["config"] == config and r["run"] == run),
                         key=lambda r: r["concurrency"])
            tps = " / ".join(f"{r['tokens_s']:.2f}" for r in got)
            vs = " / ".join(f"x{r['tokens_s'] / base[(r['concurrency'], run)]:.2f}"
                            if (r["concurrency"], run) in base else "-" for r in got)
            ms = "-" if config == "none" else " / ".join(f"{r['draft_ms']:.0f}" for r in got)
            mats = [r["mat"] for r in got if r["mat"] is not None]
            mat = f"{min(mats):.2f}-{max(mats):.2f}" if mats else "-"
            col = {k: " / ".join(str(r.get(k, 0)) for r in got)
                   for k in ("skipped", "probes", "plain_probes", "plain_steps", "lookup_rows")}
            share = " / ".join(f"{100 * r.get('budget_share', 0):.1f}%" for r in got)
            out.append(f"| {NAMES.get(config, config)} | {run} | {tps} | {vs} | {ms} | {mat} | "
                       f"{col['skipped']} | {col['probes']} | {col['plain_probes']} | "
                       f"{col['plain_steps']} | {col['lookup_rows']} | {share} |")
    for r in rows:
        if "budget_ms" in r:
            out += ["", f"{NAMES.get(r['config'], r['config'])}: the budget's own timings after "
                    "its runs, ms by batch bucket: " + "; ".join(
                        f"{k} " + ", ".join(f"{b}: {v}" for b, v in d.items())
                        for k, d in r["budget_ms"].items())]
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    for ax, (dtype, rows) in zip(axes[0], results.items(), strict=True):
        last = max(r["run"] for r in rows)
        for config in dict.fromkeys(r["config"] for r in rows):
            got = sorted((r for r in rows if r["config"] == config and r["run"] == last),
                         key=lambda r: r["concurrency"])
            ax.plot([r["concurrency"] for r in got], [r["tokens_s"] for r in got], marker="o",
                    label=NAMES.get(config, config), linestyle="--" if config == "none" else "-",
                    color=f"C{list(NAMES).index(config)}")  # one colour per configuration
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{dtype}, run {last} (steady state)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dir", default="out/vllm_bench", help="bench/vllm_tokens.py --prepare's")
    p.add_argument("--configs", default="none,self-untrimmed,self,self-dcut,hybrid,ngram",
                   help=f"of {', '.join(NAMES)}")
    p.add_argument("--bf16-only", default="self-untrimmed",
                   help="configurations run in bfloat16 only (its target is set in bf16)")
    p.add_argument("--dtypes", default="auto",
                   help="a comma list of bfloat16, float32, auto (bfloat16 where this CPU has "
                   "native bf16, else float32)")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per request")
    p.add_argument("--repeat", type=int, default=2, help="runs of each concurrency in a row")
    p.add_argument("-k", type=int, default=4, help="tokens drafted per proposal")
    p.add_argument("--memory", type=float, default=0.5, help="vLLM's gpu_memory_utilization")
    p.add_argument("--out", default="bench/results/vllm_steady",
                   help="writes OUT.md and OUT.png ('' to print only)")
    p.add_argument("--log", default="", help="a file that also gets the progress lines")
    p.add_argument("--plot", default="", metavar="OUT",
                   help="only draw OUT.png from OUT.json (a venv with matplotlib)")
    a = p.parse_args()
    if a.plot:
        with open(a.plot + ".json") as f:
            return plot(json.load(f), a.plot + ".png")
    configs = a.configs.split(",")
    bad = [c for c in configs if c not in NAMES]
    if bad:
        p.error(f"argument --configs: {bad[0]!r} is not one of {', '.join(NAMES)}")
    if "none" not in configs:
        p.error("argument --configs: 'none' is needed, every ratio is against it")
    dtypes = a.dtypes.split(",")
    if not set(dtypes) <= {"bfloat16", "float32", "auto"}:
        p.error("argument --dtypes: bfloat16, float32 and/or auto")
    if "auto" in dtypes:
        from trimpass.dtypes import fast
        best = fast()
        print(f"--dtypes auto: {best.name} ({best.why})", flush=True)
        dtypes = list(dict.fromkeys(d if d != "auto" else
                                    {"bf16": "bfloat16", "fp32": "float32"}[best.name]
                                    for d in dtypes))
    try:
        conc = [int(c) for c in a.concurrency.split(",")]
    except ValueError:
        conc = []
    if not conc or min(conc) < 1:
        p.error("argument --concurrency: a comma list of integers >= 1")
    if a.tokens < 1 or a.repeat < 1 or a.k < 1 or not 0 < a.memory <= 1:
        p.error("--tokens, --repeat and -k must be >= 1, --memory in (0, 1]")
    prompts = os.path.join(a.dir, "prompts.json")
    if not os.path.isfile(prompts):
        p.error(f"--dir: no {prompts}; run .venv/bin/python bench/vllm_tokens.py --prepare "
                f"--prompts {max(conc) + 8} --dir {a.dir}")
    from trimpass import measure
    results = {}
    for dtype in dtypes:
        rows = []
        for c in configs:
            if dtype != "bfloat16" and c in a.bf16_only.split(","):
                continue
            rows += run_config(a, c, dtype)
        results[dtype] = rows
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    cmd = "LD_PRELOAD=$PWD/.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python bench/vllm_steady.py " \
        + " ".join(sys.argv[1:])
    lines = ["# vLLM in steady state: the target drafting for itself, beside no speculation and "
             "ngram", "", f"- Command: `{cmd.strip()}`", f"- Commit: {commit}",
             f"- Machine: {measure.device_name('cpu')} ({os.cpu_count()} CPUs), no GPU; one "
             "engine at a time", "",
             f"Gemma-3-270M, eager, {a.k} drafted tokens, {a.tokens} greedy tokens per request, "
             f"the first N held-out ShareGPT prompts at N = {a.concurrency}, each run "
             f"{a.repeat} times in a row after a warm-up on 8 other prompts. Draft ms: one whole "
             "proposal; MAT: tokens per target step; skipped, probes, plain probes, plain steps: "
             "D-Cut's proposals skipped, probes drafted, proposals skipped to time a plain step "
             "(counted in skipped too), and engine steps sampled as plain decoding; lookup "
             "rows: requests' proposals that sent their lookup draft; budget's share: the "
             "budget's own host seconds (decisions, cuts, lookup indexes) over the run's wall "
             "time.", ""]
    for dtype, rows in results.items():
        lines += table(rows, dtype) + [""]
    print("\n".join(lines))
    if a.out:
        with open(a.out + ".md", "w") as f:
            f.write("\n".join(lines) + f"\n![tokens/s]({os.path.basename(a.out)}.png)\n")
        with open(a.out + ".json", "w") as f:
            json.dump(results, f)
        wrote = f"{a.out}.md, {a.out}.json"
        try:
            plot(results, a.out + ".png")
            wrote += f" and {a.out}.png"
        except ImportError:  # vLLM's venv has no matplotlib
            wrote += f"; no matplotlib here: .venv/bin/python bench/vllm_steady.py --plot {a.out}"
        log(a, f"wrote {wrote}")


if __name__ == "__main__":
    main()
