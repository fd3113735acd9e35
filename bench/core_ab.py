"""Before and after a change to the speculation core, side by side: ``trimpass.generate`` on the
real Gemma-3-270M, each installed version in its own Python (``--before``, ``--after``: interpreters
whose ``trimpass`` is the commit to compare, e.g. a venv with that commit's wheel), run in turn,
``--rounds`` times interleaved (before, after, before, after, ...) so the machine's load drifts
alike for both. Each run loads the model, warms every configuration up on a prompt it does not time,
then decodes every prompt of ``bench/hybrid.py``'s sets (chat, copy, free), or with ``--workload
lengths`` ``bench/lengths.py``'s stream of prompts of distinct lengths, greedily with each
configuration: ``trimpass.generate``'s default (lookup + trimmed self-drafts), ``lookup=False``
(trimmed self-drafts alone) and the plain target (``model.generate``, the drift control). Prints,
per configuration and round, tokens/s before and after and their ratio, graphs compiled while timed,
and whether every output is token for token the same. Only public names are used, so any two commits
compare.

    python bench/core_ab.py --before /tmp/before/bin/python --after .venv/bin/python --dtype fp32
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {"default": dict(), "lookup=False": dict(lookup=False), "plain target": None}


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="the Python whose trimpass is the commit before")
    ap.add_argument("--after", help="the Python whose trimpass is the commit after")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], required=True)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved before/after pairs")
    ap.add_argument("--workload", choices=["hybrid", "lengths"], default="hybrid",
                    help="hybrid: bench/hybrid.py's sets; lengths: bench/lengths.py's stream of "
                         "prompts of distinct lengths from 8 to 1,024 tokens")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per set (lengths: in all)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=320)
    ap.add_argument("--out", default=None, help="write the markdown here too")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # a JSON file: run and write results
    return ap.parse_args(argv)


def worker(a) -> int:
    """One run, in the Python under test: every configuration on every prompt, in turn."""
    import torch
    import transformers

    sys.path.insert(0, HERE)
    from hybrid import SETS, prompt_sets
    from lengths import lengths, prompts

    import trimpass
    from trimpass.hf import gemma as G
    from trimpass.measure import compiled_graphs
    transformers.logging.set_verbosity_error()
    model = G.load_model({"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype])
    tok = G.GGUFTokenizer()
    if a.workload == "hybrid":
        sets, names = prompt_sets(tok, a.prompts, a.prompt_tokens), SETS
    else:  # the warm-up prompt's length is none of the stream's
        stream = prompts(tok, lengths(a.prompts + 1, 8, 1024))
        sets, names = {"warm": [stream.pop(len(stream) // 2)], "stream": stream}, ("stream",)

    def run(name, ids):
        kw = CONFIGS[name]
        if kw is None:
            return model.generate(ids, max_new_tokens=a.new_tokens, do_sample=False)
        return trimpass.generate(model, ids, a.new_tokens, **kw)

    out = {"trimpass": os.path.dirname(trimpass.__file__), "rows": {}}
    with torch.no_grad():
        for name in CONFIGS:
            run(name, torch.tensor(sets["warm"]))
        for name in CONFIGS:
            out["rows"][name] = dict(seconds=0.0, tokens=0, graphs=0, outputs=[])
        for s in names:
            for p in sets[s]:
                ids = torch.tensor([p])
                for name in CONFIGS:
                    r, g, t = out["rows"][name], compiled_graphs(), time.perf_counter()
                    o = run(name, ids)
                    r["seconds"] += time.perf_counter() - t
                    r["graphs"] += compiled_graphs() - g
                    r["tokens"] += o.shape[1] - ids.shape[1]
                    r["outputs"].append(o[0].tolist())
    with open(a.worker, "w") as f:
        json.dump(out, f)
    return 0


def _one(python: str, a, path: str) -> dict:
    cmd = [python, os.path.abspath(__file__), "--dtype", a.dtype, "--prompts", str(a.prompts),
           "--workload", a.workload,
           "--new-tokens", str(a.new_tokens), "--prompt-tokens", str(a.prompt_tokens),
           "--worker", path]
    subprocess.run(cmd, check=True, cwd="/")  # from outside any tree: the installed trimpass
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> int:
    a = _args(argv)
    if a.worker:
        return worker(a)
    if not (a.before and a.after):
        sys.exit("core_ab: --before and --after are both needed (two Pythons)")
    runs = []
    for k in range(a.rounds):
        for side, python in (("before", a.before), ("after", a.after)):
            path = f"/tmp/core_ab_{os.getpid()}_{k}_{side}.json"
            print(f"round {k + 1}: {side} ({python}) ...", flush=True)
            runs.append((k, side, _one(python, a, path)))
    text = report(runs, a)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


def report(runs, a) -> str:
    by = {(k, side): r for k, side, r in runs}
    what = f"{a.prompts} prompts a set x 3 sets" if a.workload == "hybrid" else \
        f"{a.prompts} prompts of distinct lengths (8 to 1,024 tokens)"
    lines = [f"dtype {a.dtype}; {what} x {a.new_tokens} tokens; "
             f"before: {by[0, 'before']['trimpass']}; after: {by[0, 'after']['trimpass']}", "",
             "| round | configuration | before tok/s | after tok/s | after / before | graphs "
             "while timed (before, after) | outputs identical |", "|---|---|---|---|---|---|---|"]
    for k in range(a.rounds):
        b, f = by[k, "before"]["rows"], by[k, "after"]["rows"]
        for name in CONFIGS:
            tb, ta = (x[name]["tokens"] / x[name]["seconds"] for x in (b, f))
            same = sum(x == y for x, y in zip(b[name]["outputs"], f[name]["outputs"],
                                              strict=True))
            lines.append(f"| {k + 1} | {name} | {tb:.2f} | {ta:.2f} | x{ta / tb:.3f} | "
                         f"{b[name]['graphs']}, {f[name]['graphs']} | {same}/"
                         f"{len(b[name]['outputs'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
