"""Vocabulary entry: accepted forms and every bad value, checked once at configuration time."""
import pytest
import torch

from trimpass.vocab import as_index


def test_forms_and_keep(tmp_path):
    idx, count = as_index([9, 3, 5], 10, keep=[0, 3])
    assert idx.tolist() == [0, 3, 5, 9] and count.tolist() == [4]
    torch.save(torch.tensor([4, 1]), tmp_path / "v.pt")
    torch.save({"ids": torch.tensor([7])}, tmp_path / "d.pt")
    assert as_index(str(tmp_path / "v.pt"), 10)[0].tolist() == [1, 4]
    assert as_index(tmp_path / "d.pt", 10)[0].tolist() == [7]


@pytest.mark.parametrize("ids,exc,msg", [
    ([], ValueError, "vocab: is empty"),
    ([1, -2], ValueError, "negative token id -2"),
    ([1, 10], ValueError, "token id 10 but the head has only 10 rows"),
    ([4, 1, 4], ValueError, "token id 4 appears more than once"),
    (torch.tensor([1.0, 2.0]), TypeError, "must be integers"),
    ([1, 2.5], TypeError, "must be integers"),
    (torch.ones(2, 2, dtype=torch.long), ValueError, "1-D"),
    (3.5, TypeError, "expected a list"),
    ("/nonexistent/vocab.pt", ValueError, "no such file"),
])
def test_bad_vocab(ids, exc, msg):
    with pytest.raises(exc, match=msg):
        as_index(ids, 10)


def test_bad_file_contents(tmp_path):
    (tmp_path / "junk.pt").write_text("not a tensor")
    with pytest.raises(ValueError, match="could not read"):
        as_index(tmp_path / "junk.pt", 10)
    torch.save({"other": 1}, tmp_path / "d.pt")
    with pytest.raises(ValueError, match="without key 'ids'"):
        as_index(tmp_path / "d.pt", 10)
