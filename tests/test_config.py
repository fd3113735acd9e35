"""TrimConfig and the entry points: bad settings fail at configuration time, naming the argument."""
import pytest
import torch

import trimpass
from tests.graph.test_pass import TiedLM, V
from trimpass import TrimConfig, TrimpassError


@pytest.mark.parametrize("kw,msg", [
    (dict(vocab=[]), "vocab: is empty"),
    (dict(vocab=[3, -1]), "vocab: has negative token id -1"),
    (dict(vocab=[3, 3]), "vocab: token id 3 appears more than once"),
    (dict(vocab=[3, 10], vocab_size=10), "vocab: has token id 10"),
    (dict(vocab=[1.5]), "vocab: token ids must be integers"),
    (dict(vocab=[1], output="logits"), "output: must be one of"),
    (dict(vocab=[1], inner="tvm-ish"), "inner: must be one of"),
    (dict(vocab=[1], mode="max-autotune", options={"a": 1}), "mode and options"),
    (dict(keep=[-4]), "keep: has negative"),
    (dict(core=list(range(10)), capacity=8, learn_core=0), "capacity: 8 leaves no room"),
    (dict(capacity=1000), "capacity: 1000 leaves no room .* lower learn_core"),
    (dict(learn_core=-1), "learn_core: must be an int >= 0"),
    (dict(successors=17), "successors: must be an int in \\[0, 16\\]"),
    (dict(capacity=0), "capacity: must be a positive int"),
    (dict(vocab=[1], not_a_setting=1), "unexpected keyword argument 'not_a_setting'"),
])
def test_bad_configuration(kw, msg):
    with pytest.raises(TrimpassError, match=msg):
        trimpass.backend(**kw)


def test_vocab_ids_beyond_the_head_fail_with_our_message_first():
    m = TiedLM().eval()
    cm = torch.compile(m, backend=trimpass.backend(vocab=[1, V + 5], inner="aot_eager"))
    with torch.no_grad(), pytest.raises(ValueError) as err:
        cm(torch.randint(0, V, (1, 3)))
    assert str(err.value).splitlines()[0].startswith(f"vocab: has token id {V + 5}")


def test_trim_on_something_else():
    with pytest.raises(TrimpassError, match="trim: expected an nn.Module"):
        trimpass.trim(42)


def test_trim_forms_share_the_rewrite():
    vocab = [5, 17, 300]
    m = TiedLM().eval()
    ids = torch.randint(0, V, (1, 4))

    @trimpass.trim(vocab=vocab, inner="aot_eager")
    class Decorated(TiedLM):
        pass

    def fwd(ids):
        return m(ids)

    d = Decorated().eval()
    d.load_state_dict(m.state_dict())
    fn = trimpass.trim(fwd, vocab=vocab, inner="aot_eager")
    with torch.no_grad():
        for out in (d(ids), fn(ids), trimpass.trim(TiedLM().eval(), vocab=vocab)(ids)):
            assert torch.isfinite(out).sum() == 4 * len(vocab)


def test_vocab_file(tmp_path):
    torch.save(torch.tensor([7, 8, 9]), tmp_path / "v.pt")
    m = TiedLM().eval()
    with torch.no_grad():
        out = torch.compile(m, backend=trimpass.backend(vocab=str(tmp_path / "v.pt"),
                                                       inner="aot_eager"))(torch.tensor([[1]]))
    assert torch.isfinite(out[0, 0]).nonzero().flatten().tolist() == [7, 8, 9]


@pytest.mark.parametrize("setting", ["capacity", "learn_core", "successors", "refresh_every",
                                     "max_rows", "core"])
def test_dynamic_only_setting_with_a_static_vocab_is_an_error(setting):
    value = [1, 2] if setting == "core" else 4
    with pytest.raises(TrimpassError, match=rf"{setting}: a dynamic-mode setting"):
        TrimConfig(vocab=[1, 2, 3], **{setting: value})


def test_each_mode_gets_its_settings_and_defaults():
    static, dynamic = TrimConfig(vocab=[3, 1], keep=[0]), TrimConfig()
    assert not static.dynamic and static.settings.index(10, "cpu")[0].tolist() == [0, 1, 3]
    assert static.capacity is None
    assert dynamic.dynamic and (dynamic.capacity, dynamic.learn_core) == (4096, 1024)
    assert dynamic.settings.max_rows == 64
