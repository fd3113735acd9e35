"""Where the Hugging Face route's time goes on one long prompt: the real Gemma-3-270M decoding a
held-out prompt of ``--tokens`` tokens greedily, plainly (``model.generate``) and in Hugging Face's
assisted generation with the model drafting for itself (``trimpass.self_drafter``), each warmed on
another prompt first. Per route: the target's forwards (its prefill apart, by the tokens each
forward takes), the drafter's rounds (its first, which prefills the prompt, apart) and the rest
(Hugging Face's loop), in seconds; the two routes run in turn ``--repeat`` times and the medians
are printed.

    python bench/hf_route_profile.py --tokens 1024 --threads 1
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="the prompt's tokens")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="model dtype (auto: bf16 where this CPU has native bf16, else fp32)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each route, in turn")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.tokens < 8 or a.new_tokens < 1 or a.repeat < 1 or a.threads < 0:
        ap.error("need --tokens >= 8, --new-tokens >= 1, --repeat >= 1, --threads >= 0")
    return a


class Clock:
    """Seconds and calls by phase."""

    def __init__(self):
        self.s = collections.Counter()
        self.n = collections.Counter()

    def add(self, phase: str, seconds: float) -> None:
        self.s[phase] += seconds
        self.n[phase] += 1


def _time_target(model, clock: Clock):
    t = {}

    def pre(mod, args, kwargs):
        t["t0"] = time.perf_counter()

    def post(mod, args, kwargs, out):
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = ids.shape[1]
        clock.add("target prefill" if n > 32 else f"target forward over {n} token(s)"
                  if n == 1 else "target verification (2-32 tokens)", time.perf_counter() - t["t0"])
    return [model.register_forward_pre_hook(pre, with_kwargs=True),
            model.register_forward_hook(post, with_kwargs=True)]


def _time_drafter(draft, clock: Clock):
    generate = draft.generate

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = generate(*args, **kwargs)
        first = kwargs.get("past_key_values") is None or \
            kwargs["past_key_values"].get_seq_length() == 0
        clock.add("drafter round" if not first else "drafter first round (its prefill)",
                  time.perf_counter() - t0)
        return out
    draft.generate = timed


@torch.no_grad()
def main(argv=None) -> int:
    a = _args(argv)
    import transformers

    import trimpass
    from trimpass import dtypes
    from trimpass.hf import gemma as G
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from lengths import prompts
    transformers.logging.set_verbosity_error()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = G.load_model(dtypes.settle(a))
    tok = G.GGUFTokenizer()
    warm, timed = (torch.tensor([p]) for p in prompts(tok, [a.tokens - 100, a.tokens]))
    draft = trimpass.self_drafter(model)
    trimpass.warm_up(model, draft)
    routes = {"plain": {}, "self_drafter": dict(assistant_model=draft)}
    for kw in routes.values():
        model.generate(warm, do_sample=False, max_new_tokens=a.new_tokens, **kw)
    clocks = {name: [] for name in routes}
    totals = {name: [] for name in routes}
    for _ in range(a.repeat):
        for name, kw in routes.items():
            clock = Clock()
            hooks = _time_target(model, clock)
            if name == "self_drafter":
                _time_drafter(draft, clock)
            t0 = time.perf_counter()
            out = model.generate(timed, do_sample=False, max_new_tokens=a.new_tokens, **kw)
            totals[name].append(time.perf_counter() - t0)
            clock.add("tokens", 0.0)
            clock.n["tokens"] = out.shape[1] - timed.shape[1]
            for h in hooks:
                h.remove()
            if name == "self_drafter":
                del draft.generate
            clocks[name].append(clock)
    print(f"\nGemma-3-270M {a.dtype}, a {a.tokens}-token held-out prompt, {a.new_tokens} greedy "
          f"tokens, {torch.get_num_threads()} thread(s), median of {a.repeat} runs in turn")
    print("| route | phase | calls | seconds | share |")
    print("|---|---|---|---|---|")
    for name in routes:
        total = statistics.median(totals[name])
        phases = sorted({p for c in clocks[name] for p in c.s} - {"tokens"})
        accounted = 0.0
        for p in phases:
            s = statistics.median(c.s[p] for c in clocks[name])
            accounted += s
            print(f"| {name} | {p} | {statistics.median(c.n[p] for c in clocks[name]):.0f} | "
                  f"{s:.2f} | {100 * s / total:.0f}% |")
        print(f"| {name} | the rest (Hugging Face's loop) | - | {total - accounted:.2f} | "
              f"{100 * (total - accounted) / total:.0f}% |")
        print(f"| **{name}** | **total** | - | **{total:.2f}** | 100% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
