"""trimpass.select.corpora's held-out prompts: only held-out chat documents, each a usable turn,
in a stable order, cut by the tokenizer's own chat format."""
import itertools

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
