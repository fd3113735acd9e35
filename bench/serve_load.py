"""The OpenAI-compatible vLLM server under load with trimpass: Gemma-3-270M drafting for itself
through its trimmed head, with D-Cut and without, beside no speculation, on this CPU.

    .venv/bin/python bench/vllm_tokens.py --prepare --prompts 64        # checkpoints (main venv)
    LD_PRELOAD=$PWD/.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python bench/serve_load.py

Each configuration gets a fresh ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (one
at a time) and the same traffic from :mod:`trimpass.testing.serve_load`: held-out ShareGPT prompts
(``prompts.json``), mixed ``max_tokens``, half of them streamed and a third of those dropped by the
client mid-stream, a bad request after every 8th good one, at ``--concurrency``, for ``--seconds``
(no request starts later). Greedy by default: vLLM 0.32's CPU build corrupts greedy requests that
share a speculative batch with sampled ones, untrimmed too (``tests/serving/test_serve_load.py``),
so ``--sampled`` above 0 measures latency but not losslessness. The trimmed servers run without
check mode (it recomputes the full head on every call) and write their workers' counters to
``stats_dir``. Printed and written to ``--out``: requests served, aborted, rejected, failed and
preempted (vLLM's counter), tokens/s, p50/p99 time to first token and per-token inter-token
latency (each chunk's interval over its tokens), live rows after the drain, the state and compact
copy peaks against their bounds, fallbacks, and greedy outputs that differ from no speculation
(``none2``, no speculation again, gives vLLM's own rate: its CPU build is not batch-invariant).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

from trimpass.testing import serve_load as sl

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HEADER = ("configuration", "sent", "served", "aborted", "rejected", "failed", "preempted",
          "tokens/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "p99 ITL vs none", "acceptance",
          "rows after drain", "state peak / bound MB", "compact peak (packed) / bound MB",
          "fallbacks", "greedy flips vs none")
# none2: no speculation again (vLLM's own flips); untrimmed: the same self-drafter, not trimmed
CONFIGS = ("none", "none2", "untrimmed", "trimmed", "dcut")


def _server_args(a, config: str, stats_dir: str) -> list[str]:
    from trimpass.serving import vllm as tv
    target = os.path.join(a.dir, "target")
    args = ["--served-model-name", "gemma", "--skip-tokenizer-init", "--dtype", a.dtype,
            "--max-model-len", str(a.max_model_len), "--enforce-eager", "--max-num-seqs",
            str(a.concurrency), "--gpu-memory-utilization", str(a.memory),
            "--disable-hybrid-kv-cache-manager"]  # the speculative runs' KV layout, for all
    if a.num_blocks:
        args += ["--num-gpu-blocks-override", str(a.num_blocks)]
    if not config.startswith("none"):
        if config == "untrimmed":
            e = tv.engine_args(target, None, a.k, trim=False)
        else:
            e = tv.engine_args(target, None, a.k, budget="dcut" if config == "dcut" else None,
                               stats_dir=stats_dir)
        e.pop("disable_hybrid_kv_cache_manager", None)  # given above, for every configuration
        args += tv.cli_args(e)
    return args


def run(a, config: str, reqs: list) -> dict:
    stats_dir = os.path.join(a.dir, "serve_load", f"stats-{config}{_tag(a)}")
    for f in os.listdir(stats_dir) if os.path.isdir(stats_dir) else ():
        os.remove(os.path.join(stats_dir, f))
    env = {k: v for k, v in os.environ.items() if k not in ("TRIMPASS_DISABLE", "TRIMPASS_VLLM")}
    log = os.path.join(a.dir, "serve_load", f"{config}{_tag(a)}.log")
    with sl.Server(os.path.join(a.dir, "target"), _server_args(a, config, stats_dir), log,
                   env, start_timeout=600) as s:
        results, wall = sl.drive(s.url, "gemma", reqs, a.concurrency, a.seconds)
        metrics = sl.server_metrics(s.url)
        trims = config in ("trimmed", "dcut")
        stats = sl.worker_stats(stats_dir, until_rows_zero=30) if trims else []
    out = {"config": config, **sl.summary(results, wall),
           "preempted": int(metrics.get("vllm:num_preemptions", 0)),
           "drafted": int(metrics.get("vllm:spec_decode_num_draft_tokens", 0)),
           "accepted": int(metrics.get("vllm:spec_decode_num_accepted_tokens", 0)),
           "greedy": sl.greedy_outputs(results)}
    if stats:
        w = stats[0]
        out.update({k: w.get(k) for k in ("rows", "fallbacks", "calls", "peak_rows", "proposals",
                                          "propose_s", "rows_s", "head_s",
                                          "peak_state_bytes", "state_bound", "peak_compact_bytes",
                                          "peak_packed_bytes", "compact_bound")})
        out["workers"] = len(stats)
    print(json.dumps({k: v for k, v in out.items() if k != "greedy"}), flush=True)
    return out


def _tag(a) -> str:
    """bf16 rows keep the plain names; another dtype's go beside them."""
    return "" if a.dtype == "bfloat16" else f"-{a.dtype}"


def _mb(b) -> str:
    return "" if b is None else f"{b / 2**20:.1f}"


def report(a, rows: list[dict]) -> str:
    base = next((r for r in rows if r["config"] == "none"), None)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    names = {"none": "no speculation", "none2": "no speculation, again",
             "untrimmed": "self-draft, untrimmed", "trimmed": "self-draft, trimmed",
             "dcut": "self-draft, trimmed, D-Cut"}
    lines = [
        "# The OpenAI server under load (bench/serve_load.py)", "",
        f"Command: `LD_PRELOAD=$PWD/.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python "
        f"bench/serve_load.py --seconds {a.seconds:g} --requests {a.requests} --concurrency "
        f"{a.concurrency} --dtype {a.dtype} -k {a.k} --sampled {a.sampled:g}"
        + (f" --num-blocks {a.num_blocks}" if a.num_blocks else "") + "`  ",
        f"Commit {commit}; {platform.node()}, {os.cpu_count()} CPUs, vLLM 0.32.0 CPU build, "
        f"Gemma-3-270M (real weights) drafting for itself, {a.k} tokens a proposal, eager; "
        f"{time.strftime('%Y-%m-%d')}. One server at a time, each with the same traffic: "
        "held-out ShareGPT prompts, max_tokens 4..64, half streamed (a third of those dropped by "
        "the client mid-stream), a bad request after every 8th good one.", "",
        "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        ratio = (f"x{r['itl_p99_ms'] / base['itl_p99_ms']:.2f}" if base and r["itl_p99_ms"]
                 and base["itl_p99_ms"] else "")
        flips = ""
        if base and r is not base:
            f, n = sl.flips(base["greedy"], r["greedy"])
            flips = f"{f} / {n}"
        cells = [names[r["config"]], r["requests"], r["served"], r["aborted"], r["rejected"],
                 r["failed"], r["preempted"], f"{r['tokens_per_s']:.1f}",
                 f"{r['ttft_p50_ms']} / {r['ttft_p99_ms']}",
                 f"{r['itl_p50_ms']} / {r['itl_p99_ms']}", ratio,
                 f"{r['accepted'] / r['drafted']:.2f}" if r["drafted"] else "",
                 r.get("rows", ""),
                 f"{_mb(r.get('peak_state_bytes'))} / {_mb(r.get('state_bound'))}",
                 f"{_mb(r.get('peak_compact_bytes'))} ({_mb(r.get('peak_packed_bytes'))}) / "
                 f"{_mb(r.get('compact_bound'))}", r.get("fallbacks", ""), flips]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dir", default="out/vllm_bench", help="bench/vllm_tokens.py --prepare's")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--seconds", type=float, default=300.0, help="no request starts after this")
    p.add_argument("--requests", type=int, default=1500, help="good requests planned")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--sampled", type=float, default=0.0, help="fraction at temperature 0.8")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="auto: bfloat16 where this CPU has native bf16, else float32")
    p.add_argument("-k", type=int, default=4, help="tokens drafted per proposal")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--memory", type=float, default=0.3, help="vLLM's gpu_memory_utilization")
    p.add_argument("--num-blocks", type=int, default=0,
                   help="KV-cache blocks (0: vLLM's own sizing); few force preemption")
    p.add_argument("--append", action="store_true",
                   help="keep the saved rows of configurations not run now")
    p.add_argument("--report", action="store_true", help="only rewrite --out from the saved rows")
    p.add_argument("--out", default=None,
                   help="bench/results/serve_load.md (serve_load-<dtype>.md for another dtype)")
    a = p.parse_args()
    from trimpass import dtypes
    dtypes.settle(a, spelled=("bfloat16", "float32"))
    configs = a.configs.split(",")
    bad = sorted(set(configs) - set(CONFIGS))
    if bad:
        p.error(f"--configs: {bad[0]!r} is not one of {', '.join(CONFIGS)}")
    prompts_file = os.path.join(a.dir, "prompts.json")
    if not os.path.isfile(prompts_file):
        p.error(f"--dir: {prompts_file} is missing; run .venv/bin/python bench/vllm_tokens.py "
                "--prepare --prompts 64 first")
    os.makedirs(os.path.join(a.dir, "serve_load"), exist_ok=True)
    os.environ.setdefault("TRIMPASS_CACHE", os.path.join(a.dir, "cache"))
    with open(prompts_file) as f:
        prompts = json.load(f)
    reqs = sl.plan(a.requests, 262_144, a.max_model_len, seed=0, prompts=prompts,
                   max_tokens=(4, 64), sampled=a.sampled)
    saved = os.path.join(a.dir, "serve_load", f"results{_tag(a)}.json")
    a.out = a.out or os.path.join(HERE, "results", f"serve_load{_tag(a)}.md")
    rows = [] if a.report else [run(a, c, reqs) for c in configs]
    if (a.append or a.report) and os.path.isfile(saved):  # rows of configurations not run now
        with open(saved) as f:
            done = {r["config"]: r for r in json.load(f)}
        for r in done.values():
            r["greedy"] = {int(k): v for k, v in r["greedy"].items()}  # JSON keys are strings
        done.update({r["config"]: r for r in rows})
        rows = [done[c] for c in CONFIGS if c in done]
    with open(saved, "w") as f:
        json.dump(rows, f)
    text = report(a, rows)
    print(text)
    with open(a.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
