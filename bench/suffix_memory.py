"""The suffix index's memory over a long stream: a synthetic stream of requests (outputs of 2 to
``--longest`` random ids from a 262,144-id vocabulary, spread over ``--tenants`` tenants) kept in
one :class:`~trimpass.spec.proposers.suffix.SuffixStore` with a byte cap, each request first
drafting from its tenant's earlier outputs as a live request does. At checkpoints it prints what the
store counts of its own arrays, what the process allocated for it (``tracemalloc``, numpy's arrays
included) and its resident set's growth, the texts kept and evicted, and the host microseconds per
kept output and per draft. Prints a markdown table.

    python bench/suffix_memory.py --requests 10000 --cap-mib 16
"""
from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--cap-mib", type=float, default=16.0)
    ap.add_argument("--tenants", type=int, default=13)
    ap.add_argument("--longest", type=int, default=1200)
    a = ap.parse_args(argv)
    from trimpass.spec.config import SuffixConfig
    from trimpass.spec.proposers.suffix import SuffixProposer, SuffixStore
    rng = np.random.default_rng(0)
    cap = int(a.cap_mib * (1 << 20))
    store = SuffixStore(max_bytes=cap)
    config = SuffixConfig()
    tracemalloc.start()
    base_traced, base_rss = tracemalloc.get_traced_memory()[0], rss()
    add_s = draft_s = 0.0
    marks = sorted({a.requests // 10 * k for k in range(1, 11)} | {a.requests})
    print("| requests | counted MiB | traced MiB | RSS growth MiB | cap MiB | outputs kept | "
          "evicted | µs per kept output | µs per draft |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(1, a.requests + 1):
        tenant = f"t{r % a.tenants}"
        out = rng.integers(0, 262_144, int(rng.integers(2, a.longest)))
        prop = SuffixProposer(config, store, tenant)
        text = out[:32].tolist()
        t = time.perf_counter()
        prop.draft([r], [16], lambda i, x, y, text=text: text[x:y], [text[16:]], 15)
        draft_s += time.perf_counter() - t
        t = time.perf_counter()
        store.add(tenant, out)
        add_s += time.perf_counter() - t
        assert store.nbytes <= cap, (store.nbytes, cap)
        if r in marks:
            traced = tracemalloc.get_traced_memory()[0] - base_traced
            print(f"| {r} | {store.nbytes / 2**20:.2f} | {traced / 2**20:.2f} | "
                  f"{(rss() - base_rss) / 2**20:.2f} | {cap / 2**20:.2f} | {len(store)} | "
                  f"{store.evicted} | {1e6 * add_s / r:.0f} | {1e6 * draft_s / r:.0f} |",
                  flush=True)
    tracemalloc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
