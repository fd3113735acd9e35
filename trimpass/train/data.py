"""Training text for drafters: ShareGPT assistant turns, read record by record by
``trimpass.select.corpora`` and restricted to its TRAIN split (``held_out`` documents, the ones the
demo and the benches prompt with, are never used), tokenized with the model's tokenizer and packed
into fixed-length sequences up to a token budget. A tokenizer with a ``chat`` method (Gemma's
:class:`~trimpass.hf.gemma.GGUFTokenizer`) gets each reply after its prompt in the chat format the
served model sees (prompt capped, reply without a BOS); any other tokenizer is a callable, or has an
``encode`` method, from text to ids. Documents are concatenated (each ends with ``eos`` when given)
and cut into ``seq_len`` pieces; the incomplete last piece is dropped.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from trimpass.select.corpora import Doc, Tally, held_out, read

__all__ = ["train_docs", "encode_doc", "pack", "sharegpt_sequences", "heldout_sequences"]


def train_docs(docs: Iterable[Doc]) -> Iterable[Doc]:
    """The documents of the train split (never the held-out ones)."""
    return (d for d in docs if not held_out(d.doc_id))


def encode_doc(tokenizer, doc: Doc, prompt_tokens: int = 256) -> list[int]:
    if hasattr(tokenizer, "chat") and doc.prompt:
        return tokenizer.chat(doc.prompt, max_tokens=prompt_tokens) + \
            tokenizer.encode(doc.text, bos=False)
    if hasattr(tokenizer, "encode"):
        return list(tokenizer.encode(doc.text))
    if callable(tokenizer):
        return list(tokenizer(doc.text))
    raise ValueError("tokenizer must be callable (text -> ids) or have an encode method")


def pack(docs: Iterable[Doc], tokenizer: Callable | object, *, seq_len: int, tokens: int,
         eos: int | None = None) -> torch.Tensor:
    """Pack ``docs`` into ceil(tokens / seq_len) sequences [N, seq_len] (int64), or fewer when the
    documents run out (none: ValueError)."""
    for name, v in (("seq_len", seq_len), ("tokens", tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    n = -(-tokens // seq_len)
    rows, buf = [], []
    for d in docs:
        buf.extend(encode_doc(tokenizer, d))
        if eos is not None:
            buf.append(eos)
        while len(buf) >= seq_len and len(rows) < n:
            rows.append(buf[:seq_len])
            buf = buf[seq_len:]
        if len(rows) >= n:
            break
    if not rows:
        raise ValueError(f"the documents hold fewer than seq_len={seq_len} tokens")
    return torch.tensor(rows, dtype=torch.int64)


def sharegpt_sequences(tokenizer, *, seq_len: int = 256, tokens: int = 100_000,
                       eos: int | None = None, tally: Tally | None = None) -> torch.Tensor:
    """ShareGPT's train-split assistant turns, packed (see :func:`pack`)."""
    return pack(train_docs(read("sharegpt", tally)), tokenizer, seq_len=seq_len, tokens=tokens,
                eos=eos)


def heldout_sequences(tokenizer, *, seq_len: int = 256, tokens: int = 8_192,
                      eos: int | None = None) -> torch.Tensor:
    """ShareGPT's held-out assistant turns, packed: for evaluation only, never for training."""
    return pack((d for d in read("sharegpt") if held_out(d.doc_id)), tokenizer, seq_len=seq_len,
                tokens=tokens, eos=eos)
