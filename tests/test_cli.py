"""The CLI: every bad number or file fails while the arguments are parsed, with one line naming the
flag, before any model, data set or compile loads (the commands are replaced by ones that fail if
reached); good arguments still reach the command; ``--help`` shows every default."""
import argparse
import re

import pytest

from trimpass import __main__ as cli

BAD = [
    (["demo", "--prompts", "-3"], "--prompts"),
    (["demo", "--prompts", "two"], "--prompts"),
    (["demo", "--gamma", "-1"], "--gamma"),
    (["demo", "--new-tokens", "0"], "--new-tokens"),
    (["demo", "--prompt-tokens", "0"], "--prompt-tokens"),
    (["demo", "--layers", "0"], "--layers"),
    (["demo", "--layers", "19"], "--layers"),
    (["demo", "--drafter", "/no/such/file.safetensors"], "--drafter"),
    (["demo", "--inner", "nope"], "--inner"),
    (["bench", "--k", "-5"], "--k"),
    (["bench", "--k", "300000"], "--k"),
    (["bench", "--shape", "gemma3-270m", "--k", "262145"], "--k"),
    (["bench", "--m", "0"], "--m"),
    (["select", "--tokenizer", "qwen2.5", "--corpus", "sharegpt", "--min-coverage", "0"],
     "--min-coverage"),
    (["select", "--tokenizer", "qwen2.5", "--corpus", "sharegpt", "--min-coverage", "1.5"],
     "--min-coverage"),
    (["select", "--tokenizer", "qwen2.5", "--corpus", "sharegpt", "--alpha", "-0.1"], "--alpha"),
    (["select", "--tokenizer", "qwen2.5", "--corpus", "sharegpt", "--alpha", "nan"], "--alpha"),
    (["select", "--tokenizer", "qwen2.5", "--corpus", "sharegpt", "--trials", "0"], "--trials"),
    (["select", "--tokenizer", "qwen2.5", "--corpus", "sharegpt", "--vocab-size", "0"],
     "--vocab-size"),
    (["select", "--tokenizer", "qwen2.5", "--corpus", "sharegpt", "--max-k", "-1"], "--max-k"),
    (["select", "--tokenizer", "qwen2.5", "--corpus", "sharegpt", "--keep", "-2"], "--keep"),
    (["select", "--tokenizer", "qwen2.5", "--corpus", "/no/such/corpus.txt"], "--corpus"),
    (["select", "--tokenizer", "qwen2.5", "--corpus", "sharegpt:0"], "--corpus"),
    (["select", "--tokenizer", "nope", "--corpus", "sharegpt"], "--tokenizer"),
    (["train", "--tokens", "0"], "--tokens"),
    (["train", "--lr", "0"], "--lr"),
    (["train", "--lr", "abc"], "--lr"),
    (["train", "--batch", "0"], "--batch"),
    (["train", "--seq-len", "1"], "--seq-len"),
    (["train", "--temperature", "0"], "--temperature"),
    (["train", "--gamma", "0"], "--gamma"),
    (["train", "--lora-rank", "-1"], "--lora-rank"),
    (["train", "--core", "-1"], "--core"),
    (["train", "--grpo-tokens", "0"], "--grpo-tokens"),
    (["train", "--data-tokens", "-1"], "--data-tokens"),
    (["train", "--layers", "2", "--train-layers", "3"], "--train-layers"),
    (["train", "--init", "/no/such/weights.safetensors"], "--init"),
]


@pytest.fixture
def commands(monkeypatch):
    """The four commands replaced by recorders: reaching one means nothing stopped the input."""
    reached = []
    for name in ("_demo", "_bench", "_select", "_train"):
        monkeypatch.setattr(cli, name, lambda args, name=name: reached.append(name) or 0)
    return reached


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_argument_fails_before_anything_loads(commands, capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}" in err, err
    assert commands == [], f"{argv} reached the command"


@pytest.mark.parametrize("argv", [
    ["demo", "--prompts", "1", "--gamma", "0", "--layers", "18", "--drafter", "none"],
    ["bench", "--shape", "gemma3-270m", "--k", "262144", "--m", "1", "8"],
    ["select", "--tokenizer", "qwen2.5", "--corpus", "sharegpt:10", "--min-coverage", "1",
     "--alpha", "0", "--keep", "0", "1"],
    ["train", "--layers", "3", "--train-layers", "3", "--lr", "0.001", "--core", "0"],
])
def test_good_arguments_reach_the_command(commands, argv):
    assert cli.main(argv) == 0
    assert commands == ["_" + argv[0]]


def _commands():
    sub = next(a for a in cli.build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def _entries(help_text: str) -> dict[str, str]:
    """``--help``'s options section as {option: its entry}, wrapped lines joined."""
    section = help_text.split("\noptions:\n", 1)[1]
    entries = re.split(r"\n(?=  -)", "\n" + section)
    return {e.split()[0].rstrip(","): " ".join(e.split()) for e in entries if e.strip()}


@pytest.mark.parametrize("name", ["demo", "bench", "select", "train"])
def test_help_shows_every_default(name, capsys):
    with pytest.raises(SystemExit):
        cli.main([name, "--help"])
    entries = _entries(capsys.readouterr().out)
    options = [a for a in _commands()[name]._actions if a.dest != "help"]
    assert len(options) > 2
    for action in options:
        opt = action.option_strings[0]
        assert action.help, f"{name} {opt}: no help"
        assert action.required or "default" in entries[opt], f"{name} {opt}: {entries[opt]!r}"


def test_train_eagle_refuses_the_truncations_options_before_anything_loads(capsys):
    from trimpass.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["train", "--drafter", "eagle", "--lora-rank", "4"])
    assert e.value.code == 2
    assert "argument --lora-rank: not for --drafter eagle" in capsys.readouterr().err
