"""trimpass.select.corpora's split and held-out prompts: a user file splits by its documents' text,
not by where it sits; the built-in corpora keep their split; held-out prompts are only held-out
chat documents, each a usable turn, in a stable order, cut by the tokenizer's own chat format."""
import itertools
import json
import os

from trimpass.select import corpora
from trimpass.train.data import train_docs


class EchoTokenizer:
    """Returns the prompt text and the cut it was asked for, so each prompt maps back to its doc."""

    def chat(self, prompt, max_tokens):
        return [prompt, max_tokens]


def test_held_out_prompts_are_held_out_usable_turns_in_a_stable_order():
    got = corpora.held_out_prompts(EchoTokenizer(), 6, 9)
    assert len(got) == 6 and all(cut == 9 for _, cut in got)
    assert got == corpora.held_out_prompts(EchoTokenizer(), 6, 9)
    assert got[:3] == corpora.held_out_prompts(EchoTokenizer(), 3, 9)
    docs = {d.prompt: d for d in itertools.islice(corpora.read("sharegpt"), 5000)}
    for prompt, _ in got:
        d = docs[prompt]
        assert corpora.held_out(d.doc_id) and 16 <= len(prompt) <= 4000
    trained = {d.doc_id for d in train_docs(itertools.islice(corpora.read("sharegpt"), 5000))}
    assert not trained & {docs[p].doc_id for p, _ in got}, "a training document was held out"


def _split(path):
    return [(d.text, corpora.held_out(d.doc_id)) for d in corpora.read(str(path))]


def test_a_user_file_splits_the_same_wherever_it_sits_and_whatever_its_name(tmp_path,
                                                                            monkeypatch):
    docs = [f"document {k} " + "word " * (k % 7) for k in range(300)]
    body = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    here, there = tmp_path / "a" / "c.jsonl", tmp_path / "b" / "deeper" / "renamed.jsonl"
    for p in (here, there):
        p.parent.mkdir(parents=True)
        p.write_text(body)
    split = _split(here)
    assert [t for t, _ in split] == docs and 10 <= sum(h for _, h in split) <= 60
    assert _split(there) == split
    monkeypatch.chdir(here.parent)
    assert _split("c.jsonl") == split  # a relative path too
    there.write_text(json.dumps({"text": "a new first document"}) + "\n" + body)
    assert _split(there)[1:] == split  # no other document crosses the split
    there.with_suffix(".txt").write_text("\n\n".join(docs))
    assert _split(there.with_suffix(".txt")) == split  # the same texts as plain-text paragraphs


def test_copies_of_a_text_spread_over_both_splits(tmp_path):
    p = tmp_path / "same.txt"
    p.write_text("\n\n".join(["a b c"] * 40))
    held = [h for _, h in _split(p)]
    assert len(held) == 40 and any(held) and not all(held)


def test_built_in_corpora_keep_their_split():
    # the demo's and the benchmarks' prompts (README, bench/results) are these held-out turns
    assert [d.doc_id for d in itertools.islice(corpora.held_out_chats(), 4)] == [
        "sharegpt/QWJhYvA_0/7", "sharegpt/VY7cMKG_0/5", "sharegpt/VY7cMKG_0/7",
        "sharegpt/wNBG8Gp_0/9"]
    pydoc = {d.doc_id for d in corpora.read("pydoc") if corpora.held_out(d.doc_id)}
    assert {"pydoc/if", "pydoc/lambda"} <= pydoc
    ids = [d.doc_id for d in corpora.read("stdlib")]
    assert ids[0] == "__future__.py" and {"calendar.py", "copy.py"} <= set(ids)
    assert corpora.held_out("calendar.py") and corpora.held_out("copy.py")
    # the standard library's own source: not the machine's site-packages, tests or IDLE
    skipped = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    assert not [i for i in ids if skipped & set(i.split(os.sep)) or os.path.isabs(i)]
