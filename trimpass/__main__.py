"""Command line: ``python -m trimpass {demo,bench,select,train} ...`` (``--help`` on each)."""
from __future__ import annotations

import argparse
import os
import sys

from trimpass.shapes import HEADS


def _demo(args) -> int:
    from trimpass.demo import main as demo
    return demo(args)


def _bench(args) -> int:
    import torch

    from trimpass.headbench import format_table, time_head
    from trimpass.progress import progress

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = args.shape or list(HEADS)
    cases = [(s, K, M) for s in shapes for K in args.k for M in args.m]
    rows = [time_head(s, K, M, device=device) for s, K, M in progress(cases, desc="timing")]
    print(format_table(rows))
    return 0


def _run_checked(run, args):
    """``run(args)``, or ``None`` after one clear line on stderr for bad input (no traceback)."""
    try:
        return run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def _select(args) -> int:
    from trimpass.select.report import run
    r = _run_checked(run, args)
    if r is None:
        return 2
    print(f"chosen K = {r['K']:,} of {r['head_vocab_size']:,} (alpha={r['alpha']}, "
          f"min coverage {r['min_coverage']}, {r['trials']} TPE trials, "
          f"cost model {r['cost_model']})")
    for name, cov in {**r["heldout_coverage"], **r["eval_coverage"]}.items():
        print(f"  held-out coverage on {name}: {cov:.4f}")
    print(f"  predicted latency reduction: {100 * r['predicted_reduction']:.1f}%")
    for name, c in r["counting"].items():
        print(f"  counted {name}: {c['tokens']:,} tokens in {c['docs']:,} documents "
              f"({c['skipped']} malformed records skipped); counting "
              f"{c['counting_tokens_per_s'] / 1e6:.0f}M tokens/s")
    print(f"wrote {r['out']} (load with trimpass.backend(vocab=...)), "
          f"{os.path.splitext(r['out'])[0]}.json and {r['png']}")
    return 0


def _train(args) -> int:
    from trimpass.train.trainer import run_cli as run
    r = _run_checked(run, args)
    if r is None:
        return 2
    print(f"trained {r.steps} steps, {r.tokens:,} tokens in {r.wall_s:.1f}s "
          f"({r.tokens_per_s:,.0f} tokens/s); last loss {r.losses[-1] if r.losses else 'n/a'}")
    print(f"wrote {r.weights} (load with trimpass.models.gemma3_270m_drafter(weights=...))")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trimpass",
        description="Trim a speculative-decoding drafter's LM head to an active vocabulary.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="the main job: the real Gemma-3-270M drafter, trimmed vs not",
                       description="Hugging Face assisted generation with the real Gemma-3-270M: "
                       "target at full vocabulary, a truncated drafter trimmed by trimpass and "
                       "not; prints a table and writes a PNG.")
    d.add_argument("--prompts", type=int, default=8, help="ShareGPT prompts (default: %(default)s)")
    d.add_argument("--new-tokens", type=int, default=64,
                   help="tokens per prompt (default: %(default)s)")
    d.add_argument("--prompt-tokens", type=int, default=96, help="prompt length cap")
    d.add_argument("--layers", type=int, default=2, help="drafter's decoder layers")
    d.add_argument("--gamma", type=int, default=1,
                   help="tokens drafted per verification, fixed so MAT compares like with like; "
                   "the default is the fastest measured for the shipped drafter, whose second "
                   "draft is almost never accepted (0: HF's dynamic schedule, whose confidence "
                   "stop reacts to the trimmed drafter's sharper probabilities; default: "
                   "%(default)s)")
    d.add_argument("--drafter", default="shipped", metavar="WEIGHTS",
                   help="the drafter's trained weights: 'shipped' (trained for acceptance, ships "
                   "with trimpass), a drafter.safetensors from `trimpass train`, or 'none' (the "
                   "untrained truncation; default: %(default)s)")
    d.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16",
                   help="target and drafter dtype; in bf16 (faster here: AMX verifies 5 tokens "
                   "for about the cost of 1) the target verifies row-invariantly "
                   "(trimpass.hf.exact), so the output stays identical to its own decoding "
                   "(default: %(default)s)")
    d.add_argument("--inner", default="inductor",
                   help="inner compiler for both drafters: inductor (trimpass.trim's default, "
                   "what a user gets) or aot_eager (compiles in half the time; default: "
                   "%(default)s)")
    d.add_argument("--device", help="cuda or cpu (default: cuda when a GPU is present)")
    d.add_argument("--out", default="out", help="folder for demo.png")
    d.set_defaults(fn=_demo)

    b = sub.add_parser("bench", help="time full vs trimmed vs pre-gathered heads, as ratios",
                       description="Side-by-side head timings on real drafters' shapes.")
    b.add_argument("--shape", nargs="+", help="gemma3-270m, qwen2.5-0.5b, eagle-llama3-8b",
                   choices=sorted(HEADS))
    b.add_argument("--k", type=int, nargs="+", default=[1000, 3000, 8000, 32000])
    b.add_argument("--m", type=int, nargs="+", default=[1, 8, 64])
    b.set_defaults(fn=_bench)

    s = sub.add_parser("select", help="choose a static vocabulary from real text (TPE search)",
                       description="Count tokens on real corpora, then search the kept size K "
                       "for the best alpha*coverage + (1-alpha)*latency reduction with coverage "
                       ">= --min-coverage, measured on held-out documents.")
    s.add_argument("--tokenizer", required=True,
                   help="qwen2.5, qwen3.6, llama3, qwen3, o200k, cl100k or gemma3")
    s.add_argument("--corpus", action="append", required=True, metavar="SPEC",
                   help="sharegpt, stdlib, pydoc or a file (.txt, .jsonl, chat .json); ':N' "
                   "keeps N documents; repeat for several (mixing weights are searched too)")
    s.add_argument("--eval", nargs="*", metavar="SPEC", help="extra corpora to report "
                   "held-out coverage on")
    s.add_argument("--min-coverage", type=float, default=0.95)
    s.add_argument("--alpha", type=float, default=0.5, help="weight of coverage in the utility")
    s.add_argument("--cost", choices=["flops", "measured"], default="flops",
                   help="latency model: drafter FLOPs, or the timed trimmed op on this device")
    s.add_argument("--drafter", help="gemma3-270m, qwen2.5-0.5b or eagle-llama3-8b (shape)")
    s.add_argument("--vocab-size", type=int, help="rows of the drafter's head")
    s.add_argument("--max-k", type=int, help="largest K to consider")
    s.add_argument("--keep", type=int, nargs="*", help="ids always kept (EOS, BOS, pad)")
    s.add_argument("--trials", type=int, default=100)
    s.add_argument("--export-sglang", metavar="PATH", help="also write SGLang's token map")
    s.add_argument("--export-eagle3", metavar="PATH", help="also write EAGLE-3 d2t/t2d")
    s.add_argument("--out", default="vocab.pt")
    s.set_defaults(fn=_select)

    t = sub.add_parser("train", help="train the Gemma-3-270M drafter for acceptance length",
                       description="Cache the real Gemma-3-270M's top-k outputs on ShareGPT's "
                       "train split, then train the truncated drafter's last layers with a "
                       "distillation (kl) or acceptance-length (eal, wtv) loss, optionally "
                       "followed by a GRPO stage; resumes from --out.")
    t.add_argument("--loss", choices=["kl", "eal", "wtv"], default="kl")
    t.add_argument("--grpo", action="store_true", help="add a GRPO stage after the base loss")
    t.add_argument("--tokens", type=int, default=100_000, help="training token budget")
    t.add_argument("--grpo-tokens", type=int, help="GRPO stage budget (default: tokens / 4)")
    t.add_argument("--data-tokens", type=int, help="tokens of text cached (default: --tokens)")
    t.add_argument("--layers", type=int, default=2, help="drafter's decoder layers")
    t.add_argument("--train-layers", type=int, default=1, help="last layers trained (+ norm)")
    t.add_argument("--gamma", type=int, default=4, help="tokens drafted per window")
    t.add_argument("--temperature", type=float, default=1.0)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--batch", type=int, default=4)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--init", metavar="WEIGHTS",
                   help="start from these drafter weights (a safetensors file, e.g. a kl run's "
                   "drafter.safetensors): eal/wtv barely move an untrained drafter")
    t.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help="train rank-R LoRA adapters (+ norms) instead of the full layers: a "
                   "weights file of a few MB (0: full layers)")
    t.add_argument("--core", type=int, default=2048, metavar="N",
                   help="trimming-aware: the head is trained over the N most frequent cached "
                   "ids plus each batch's target top-32 (N=0: the full vocabulary, ~10x slower)")
    t.add_argument("--cache-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the target's dtype while caching its outputs (bf16: ~2x faster here)")
    t.add_argument("--no-resume", action="store_true", help="ignore a checkpoint in --out")
    t.add_argument("--export-hf", action="store_true", help="also write OUT/hf (vLLM-loadable)")
    t.add_argument("--out", default="train-out", help="folder for checkpoints and weights")
    t.set_defaults(fn=_train)

    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
