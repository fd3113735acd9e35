"""Host reads per round of ``trimpass.generate``, counted the way ``tests/hf/test_rounds.py``
counts them (:class:`trimpass.testing.nosync.host_reads`, loaded from this checkout's file, so
the count runs against any ``trimpass`` on the path: an older commit's too). Small random-weight
Gemma-3 and Llama models, a random and a repeating prompt, greedy and sampled; one warm-up call of
8 tokens, then one call of 40 counted. Prints a markdown row per case: rounds, near-tie rechecks,
reads, and reads a round beyond the call's two (the prompt's ids, the first token).

    PYTHONPATH=<checkout> python bench/host_reads.py
"""
from __future__ import annotations

import importlib.util
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _counter():
    path = os.path.join(HERE, "..", "trimpass", "testing", "nosync.py")
    spec = importlib.util.spec_from_file_location("trimpass_nosync_here", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.host_reads


def main() -> int:
    import trimpass
    from tests.graph.test_hf import V
    from tests.hf.test_selfdraft import MODELS
    host_reads, fast = _counter(), dict(inner="aot_eager", learn_core=64)
    print(f"trimpass from {os.path.dirname(trimpass.__file__)}\n")
    print("| model | prompt | mode | rounds | rechecks | reads | reads a round |")
    print("|---|---|---|---|---|---|---|")
    for name in ("gemma3", "llama"):
        for prompt in ("random", "repeating"):
            for sample in (False, True):
                torch._dynamo.reset()
                torch.manual_seed(0)
                model = MODELS[name]().eval()
                ids = torch.randint(0, V, (1, 11)).repeat(1, 4 if prompt == "repeating" else 1)
                kw = dict(do_sample=True, temperature=0.8) if sample else {}
                trimpass.generate(model, ids, 8, **fast, **kw)
                before = trimpass.stats(model)
                with host_reads() as r:
                    trimpass.generate(model, ids, 40, **fast, **kw)
                after = trimpass.stats(model)
                rounds = after["rounds"] - before["rounds"]
                print(f"| {name} | {prompt} | {'sampled' if sample else 'greedy'} | {rounds} | "
                      f"{after['rechecks'] - before['rechecks']} | {r.count} | "
                      f"{(r.count - 2) / rounds:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
