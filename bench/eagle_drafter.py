"""An EAGLE-style drafter for the real Gemma-3-270M, trained here (trimpass.train.eagle), against
the drafters we have: held-out top-1 agreement with the target's greedy token (the first drafted
token, and the second drafted from the drafter's own output where the first agreed) as training
tokens grow, beside the shipped 2-layer truncation and the untrained one on the same held-out
positions.

    .venv/bin/python bench/eagle_drafter.py --tokens 65536 --train-tokens 262144

The target runs once over the training and held-out text (ShareGPT's train split and held-out
documents, Gemma's chat format), bf16; its outputs and final hidden states are kept under --dir
for reruns. Writes --out (a table with the command, commit and machine) and a PNG beside it.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from trimpass.train import eagle  # noqa: E402


def _outputs(target, ids, path):
    if os.path.isfile(path):
        cache, feats = torch.load(path, weights_only=False)
        if torch.equal(cache.ids, ids):
            return cache, feats
    cache, feats = eagle.target_outputs(target, ids, model_key="gemma3-270m-q4_k_m/bf16")
    torch.save((cache, feats), path)
    return cache, feats


@torch.no_grad()
def truncation_agreement(drafter, cache, batch: int = 2) -> list[float]:
    """The same two numbers for a truncated drafter: top-1 agreement at positions 1.. (where the
    EAGLE drafter's first guesses land), and at the next position where that one agreed."""
    hit, n = [0, 0], [0, 0]
    for i in range(0, len(cache.ids), batch):
        ids = cache.ids[i:i + batch]
        top = drafter(input_ids=ids).logits.argmax(-1)
        right = top[:, 1:] == cache.greedy[i:i + batch, 1:]
        second = right[:, 1:] & right[:, :-1]
        hit[0] += int(right.sum())
        n[0] += right.numel()
        hit[1] += int(second.sum())
        n[1] += int(right[:, :-1].sum())
    return [h / max(c, 1) for h, c in zip(hit, n, strict=True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, default=65_536, help="training text cached, tokens")
    p.add_argument("--train-tokens", type=int, default=262_144, help="positions trained")
    p.add_argument("--heldout", type=int, default=4_096, help="held-out tokens evaluated")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--loss", default="kl", choices=("kl", "eal", "wtv"))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ttt", type=int, default=2, help="chained training-time-test steps")
    p.add_argument("--core", type=int, default=4096, help="frequency core of the trained columns")
    p.add_argument("--evals", type=int, default=6, help="points on the learning curve")
    p.add_argument("--dir", default="out/eagle", help="target outputs and the checkpoint")
    p.add_argument("--out", default=os.path.join(HERE, "results", "eagle_drafter.md"))
    a = p.parse_args()
    for name in ("tokens", "train_tokens", "heldout", "seq_len", "batch", "ttt", "evals"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    if not a.lr > 0:
        p.error("--lr: must be > 0")
    from trimpass.hf.gemma import END_TURN, GGUFTokenizer
    from trimpass.models import gemma3_270m, gemma3_270m_drafter
    from trimpass.train.data import heldout_sequences, sharegpt_sequences
    os.makedirs(a.dir, exist_ok=True)
    tok = GGUFTokenizer()
    train_ids = sharegpt_sequences(tok, seq_len=a.seq_len, tokens=a.tokens, eos=END_TURN)
    held_ids = heldout_sequences(tok, seq_len=a.seq_len, tokens=a.heldout, eos=END_TURN)
    target = gemma3_270m(torch.bfloat16)
    t0 = time.perf_counter()
    cache, feats = _outputs(target, train_ids, os.path.join(a.dir, f"train-{a.tokens}.pt"))
    held, hfeats = _outputs(target, held_ids, os.path.join(a.dir, f"held-{a.heldout}.pt"))
    cache_s = time.perf_counter() - t0
    rows = []
    for name, weights in (("shipped 2-layer truncation", "shipped"),
                          ("untrained 2-layer truncation", None)):
        d = gemma3_270m_drafter(torch.bfloat16, weights=weights)
        rows.append((name, "", *truncation_agreement(d, held)))
        print(rows[-1], flush=True)
        del d
    torch.manual_seed(0)
    drafter = eagle.EagleDrafter(target)
    curve = [(0, *eagle.agreement(drafter, held, hfeats))]
    print(curve[-1], flush=True)

    def on_eval(seen):
        curve.append((seen, *eagle.agreement(drafter, held, hfeats)))
        print(curve[-1], flush=True)

    every = max(1, a.train_tokens // a.evals)
    info = eagle.train_eagle(drafter, cache, feats, tokens=a.train_tokens, loss=a.loss, lr=a.lr,
                             batch=a.batch, ttt=a.ttt, core=a.core, every=every, on_eval=on_eval)
    eagle.save_eagle(drafter, os.path.join(a.dir, "eagle-ckpt"))
    n_params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    _write(a, rows, curve, info, n_params, cache_s, len(train_ids) * a.seq_len)


def _write(a, rows, curve, info, n_params, cache_s, cached):
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    png = os.path.splitext(a.out)[0] + ".png"
    lines = ["# An EAGLE-style Gemma-3-270M drafter trained here (bench/eagle_drafter.py)", "",
             f"Command: `.venv/bin/python bench/eagle_drafter.py --tokens {a.tokens} "
             f"--train-tokens {a.train_tokens} --heldout {a.heldout} --loss {a.loss} --lr {a.lr:g} "
             f"--batch {a.batch} --ttt {a.ttt} --core {a.core}`  ",
             f"Commit {commit}; {platform.node()}, {os.cpu_count()} CPUs, torch "
             f"{torch.__version__}; {time.strftime('%Y-%m-%d')}. Target: the real Gemma-3-270M, "
             f"bf16. {cached:,} training tokens cached ({cache_s:.0f} s for the target's one pass "
             f"over them and the held-out text); {info['tokens']:,} positions trained in "
             f"{info['wall_s']:.0f} s ({info['steps']} steps); {n_params / 1e6:.1f}M trained "
             "parameters (fc + one Llama decoder layer; the target's embedding and head shared). "
             f"Held out: {a.heldout:,} tokens of ShareGPT's held-out documents.", "",
             "| drafter | positions trained | first token agrees | second token agrees (where "
             "the first did) |", "|---|---|---|---|"]
    for name, _, a1, a2 in rows:
        lines.append(f"| {name} | | {a1:.3f} | {a2:.3f} |")
    for seen, a1, a2 in curve:
        lines.append(f"| EAGLE-style, trained here | {seen:,} | {a1:.3f} | {a2:.3f} |")
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([c[0] for c in curve], [c[1] for c in curve], "o-", label="EAGLE-style, first token")
    for (name, _, a1, _), style in zip(rows, ("--", ":"), strict=True):
        ax.axhline(a1, ls=style, color="gray", label=name)
    ax.set_xlabel("positions trained")
    ax.set_ylabel("held-out top-1 agreement")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
