"""Command line: ``python -m trimpass {demo,bench,select,train} ...`` (``--help`` on each, with
every default). Every number and file argument is checked while the arguments are parsed, before
any model, data set or compile loads: a bad one is a one-line error naming the flag and what it
takes (exit 2)."""
from __future__ import annotations

import argparse
import os
import sys

from trimpass.select.corpora import CorpusError, parse_spec
from trimpass.select.tokenizers import REGISTRY as TOKENIZERS
from trimpass.shapes import DRAFTERS, HEADS

GEMMA_LAYERS = DRAFTERS["gemma3-270m"].layers  # what the demo's and train's drafters truncate


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
    if args.drafter == "eagle":
        from trimpass.train.eagle import run_cli as run
    else:
        from trimpass.train.trainer import run_cli as run
    r = _run_checked(run, args)
    if r is None:
        return 2
    print(f"trained {r.steps} steps, {r.tokens:,} tokens in {r.wall_s:.1f}s "
          f"({r.tokens_per_s:,.0f} tokens/s); last loss {r.losses[-1] if r.losses else 'n/a'}")
    if args.drafter == "eagle":
        print(f"wrote {r.weights} (a vLLM EAGLE checkpoint: trimpass.serving.vllm.engine_args("
              "target_dir, it, method='eagle'))")
    else:
        print(f"wrote {r.weights} (load with trimpass.models.gemma3_270m_drafter(weights=...))")
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each argument's default, unless its help already says what the default is."""

    def _get_help_string(self, action):
        if action.required or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _number(kind, lo=None, hi=None, lo_open=False):
    """An argparse ``type``: ``kind`` (int or float) within [lo, hi] ((lo, hi] if ``lo_open``)."""
    low = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
    span = (f"in {'(' if lo_open else '['}{lo}, {hi}]" if lo is not None and hi is not None
            else low or f"<= {hi}")
    what = f"{'an integer' if kind is int else 'a number'} {span}"

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if v != v or (lo is not None and (v <= lo if lo_open else v < lo)) or \
                (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{text} is not {what}; pass {what}")
        return v

    parse.__name__ = kind.__name__
    return parse


def _file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file {text!r}")
    return text


def _weights(text: str) -> str:
    if text in ("shipped", "none") or os.path.isfile(text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither 'shipped', 'none' nor an existing "
                                     "file; pass a drafter.safetensors from `trimpass train`")


def _corpus(text: str) -> str:
    try:
        parse_spec(text)
    except CorpusError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _demo_args(d) -> None:
    d.add_argument("--prompts", type=_number(int, 1), default=8, help="held-out ShareGPT prompts")
    d.add_argument("--new-tokens", type=_number(int, 1), default=64, help="tokens per prompt")
    d.add_argument("--prompt-tokens", type=_number(int, 1), default=96,
                   help="prompt length cap, in tokens")
    d.add_argument("--layers", type=_number(int, 1, GEMMA_LAYERS), default=2,
                   help="drafter's decoder layers (the shipped drafter has 2)")
    d.add_argument("--gamma", type=_number(int, 0, 64), default=1,
                   help="tokens drafted per verification, fixed so MAT compares like with like; "
                   "the default is the fastest measured for the shipped drafter, whose second "
                   "draft is almost never accepted (0: HF's dynamic schedule, whose confidence "
                   "stop reacts to the trimmed drafter's sharper probabilities)")
    d.add_argument("--drafter", default="shipped", metavar="WEIGHTS", type=_weights,
                   help="the drafter's trained weights: 'shipped' (trained for acceptance, ships "
                   "with trimpass), a drafter.safetensors from `trimpass train`, or 'none' (the "
                   "untrained truncation)")
    d.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="target and drafter dtype; auto: bf16 on CUDA and on a CPU with native "
                   "bf16 (AMX or AVX-512 BF16: 5 tokens verified for about the cost of 1), else "
                   "fp32 (without it several-row bf16 products are emulated and slow); in bf16 "
                   "the target verifies row-invariantly (trimpass.hf.exact), so the output stays "
                   "identical to its own decoding; in fp32 each divergence is explained (near-tie "
                   "or not)")
    d.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager", "eager"],
                   help="inner compiler for both drafters: inductor (trimpass.trim's default, "
                   "what a user gets) or aot_eager (compiles in half the time)")
    d.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the whole model drafting for itself in the fused loop "
                   "(trimpass.generate with its defaults: lookup drafts and trimmed "
                   "self-drafts), the fastest configuration measured here")
    d.add_argument("--device", choices=["cpu", "cuda"],
                   help="where the models run (default: cuda when a GPU is present, else cpu)")
    d.add_argument("--out", default="out", help="folder for demo.png")


def _bench_args(b) -> None:
    b.add_argument("--shape", nargs="+", choices=sorted(HEADS),
                   help="real drafters' head shapes to time (default: all of them)")
    b.add_argument("--k", type=_number(int, 1), nargs="+", default=[1000, 3000, 8000, 32000],
                   help="active vocabulary sizes K (each at most the shape's vocabulary)")
    b.add_argument("--m", type=_number(int, 1, 4096), nargs="+", default=[1, 8, 64],
                   help="rows (positions) per head call")


def _select_args(s) -> None:
    s.add_argument("--tokenizer", required=True,
                   choices=sorted(TOKENIZERS),
                   help="the drafter's tokenizer (required)")
    s.add_argument("--corpus", action="append", required=True, metavar="SPEC", type=_corpus,
                   help="sharegpt, stdlib, pydoc or a file (.txt, .jsonl, chat .json); ':N' "
                   "keeps N documents; repeat for several, their mixing weights are searched "
                   "too (required)")
    s.add_argument("--eval", nargs="*", metavar="SPEC", type=_corpus,
                   help="extra corpora to report held-out coverage on (default: none)")
    s.add_argument("--min-coverage", type=_number(float, 0.0, 1.0, lo_open=True), default=0.95,
                   help="the least held-out coverage the chosen K must reach")
    s.add_argument("--alpha", type=_number(float, 0.0, 1.0), default=0.5,
                   help="weight of coverage in the utility (1 - alpha: latency reduction)")
    s.add_argument("--cost", choices=["flops", "measured"], default="flops",
                   help="latency model: drafter FLOPs, or the timed trimmed op on this device")
    s.add_argument("--drafter", choices=sorted(DRAFTERS),
                   help="the drafter's shape for the cost model (default: the tokenizer's "
                   "vocabulary, d = 640)")
    s.add_argument("--vocab-size", type=_number(int, 1),
                   help="rows of the drafter's head (default: the drafter's or the tokenizer's)")
    s.add_argument("--max-k", type=_number(int, 1),
                   help="largest K to consider (default: the vocabulary)")
    s.add_argument("--keep", type=_number(int, 0), nargs="*",
                   help="ids always kept, e.g. EOS, BOS, pad (default: none)")
    s.add_argument("--trials", type=_number(int, 1, 100_000), default=100,
                   help="TPE search trials")
    s.add_argument("--export-sglang", metavar="PATH",
                   help="also write SGLang's token map (default: not written)")
    s.add_argument("--export-eagle3", metavar="PATH",
                   help="also write EAGLE-3 d2t/t2d (default: not written)")
    s.add_argument("--out", default="vocab.pt", help="where the chosen ids go")


def _train_args(t) -> None:
    t.add_argument("--drafter", choices=["truncation", "eagle"], default="truncation",
                   help="truncation: the target's first --layers layers; eagle: one Llama "
                   "layer over the target's last hidden state and the next token (written as a "
                   "vLLM EAGLE checkpoint, OUT/eagle)")
    t.add_argument("--ttt", type=_number(int, 1, 8), default=2,
                   help="eagle: chained training-time-test steps over its own outputs")
    t.add_argument("--loss", choices=["kl", "eal", "wtv"], default="kl",
                   help="distillation (kl) or expected acceptance length (eal greedy, wtv "
                   "sampling)")
    t.add_argument("--grpo", action="store_true", help="add a GRPO stage after the base loss")
    t.add_argument("--tokens", type=_number(int, 1), default=100_000,
                   help="training token budget")
    t.add_argument("--grpo-tokens", type=_number(int, 1),
                   help="GRPO stage budget (default: tokens / 4)")
    t.add_argument("--data-tokens", type=_number(int, 1),
                   help="tokens of text cached (default: --tokens)")
    t.add_argument("--layers", type=_number(int, 1, GEMMA_LAYERS), default=2,
                   help="drafter's decoder layers")
    t.add_argument("--train-layers", type=_number(int, 1, GEMMA_LAYERS), default=1,
                   help="last layers trained (+ norm), at most --layers")
    t.add_argument("--gamma", type=_number(int, 1, 64), default=4,
                   help="tokens drafted per window")
    t.add_argument("--temperature", type=_number(float, 0.0, lo_open=True), default=1.0,
                   help="the target's and drafter's softmax temperature")
    t.add_argument("--lr", type=_number(float, 0.0, 1.0, lo_open=True),
                   help="AdamW learning rate (default: 1e-4; 1e-3 for --drafter eagle, trained "
                   "from scratch)")
    t.add_argument("--batch", type=_number(int, 1), default=4, help="sequences per step")
    t.add_argument("--seq-len", type=_number(int, 2), default=256, help="tokens per sequence")
    t.add_argument("--seed", type=_number(int, 0), default=0, help="random seed")
    t.add_argument("--init", metavar="WEIGHTS", type=_file,
                   help="start from these drafter weights (a safetensors file, e.g. a kl run's "
                   "drafter.safetensors): eal/wtv barely move an untrained drafter (default: "
                   "the truncation's own weights)")
    t.add_argument("--lora-rank", type=_number(int, 0), default=0, metavar="R",
                   help="train rank-R LoRA adapters (+ norms) instead of the full layers: a "
                   "weights file of a few MB (0: full layers)")
    t.add_argument("--core", type=_number(int, 0, DRAFTERS["gemma3-270m"].V), default=2048,
                   metavar="N", help="trimming-aware: the head is trained over the N most "
                   "frequent cached ids plus each batch's target top-32 (N=0: the full "
                   "vocabulary, ~10x slower)")
    t.add_argument("--cache-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the target's dtype while caching its outputs (bf16: ~2x faster here)")
    t.add_argument("--no-resume", action="store_true", help="ignore a checkpoint in --out")
    t.add_argument("--export-hf", action="store_true", help="also write OUT/hf (vLLM-loadable)")
    t.add_argument("--out", default="train-out", help="folder for checkpoints and weights")


def _check(args) -> None:
    """What depends on two arguments or on the machine, still before anything loads."""
    p = args.command_parser
    if args.cmd == "bench":
        for name in args.shape or sorted(HEADS):
            V = HEADS[name][0]
            if max(args.k) > V:
                p.error(f"argument --k: {max(args.k)} exceeds {name}'s vocabulary of {V:,}; "
                        f"pass K <= {V:,} (or drop that --shape)")
    if args.cmd == "train" and args.drafter == "eagle":
        for flag, on in (("--grpo", args.grpo), ("--lora-rank", args.lora_rank),
                         ("--init", args.init), ("--export-hf", args.export_hf)):
            if on:
                p.error(f"argument {flag}: not for --drafter eagle (trained whole from scratch, "
                        "written as a vLLM EAGLE checkpoint); drop it")
    if args.cmd == "train" and args.train_layers > args.layers:
        p.error(f"argument --train-layers: {args.train_layers} exceeds --layers {args.layers}; "
                "pass at most the drafter's layers")
    if args.cmd == "demo" and args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            p.error("argument --device: cuda was asked for, but no CUDA device is available; "
                    "pass --device cpu")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trimpass", formatter_class=_Help,
        description="Trim a speculative-decoding drafter's LM head to an active vocabulary.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    commands = [
        ("demo", _demo, _demo_args, "the main job: the real Gemma-3-270M drafter, trimmed vs not",
         "Hugging Face assisted generation with the real Gemma-3-270M: target at full "
         "vocabulary, a truncated drafter trimmed by trimpass and not; prints a table and writes "
         "a PNG. Each phase logs a line on stderr as it ends, with about how long the rest will "
         "take."),
        ("bench", _bench, _bench_args, "time full vs trimmed vs pre-gathered heads, as ratios",
         "Side-by-side head timings on real drafters' shapes."),
        ("select", _select, _select_args, "choose a static vocabulary from real text (TPE search)",
         "Count tokens on real corpora, then search the kept size K for the best "
         "alpha*coverage + (1-alpha)*latency reduction with coverage >= --min-coverage, "
         "measured on held-out documents."),
        ("train", _train, _train_args, "train the Gemma-3-270M drafter for acceptance length",
         "Cache the real Gemma-3-270M's top-k outputs on ShareGPT's train split, then train the "
         "truncated drafter's last layers with a distillation (kl) or acceptance-length (eal, "
         "wtv) loss, optionally followed by a GRPO stage; resumes from --out."),
    ]
    for name, fn, add, short, long in commands:
        c = sub.add_parser(name, help=short, description=long, formatter_class=_Help)
        add(c)
        c.set_defaults(fn=fn, command_parser=c)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    _check(args)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
