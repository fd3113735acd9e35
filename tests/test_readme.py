"""The usage examples of the README and docs/ run as written (those that need no file of the
user's); CI runs the README's test command."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))
README = os.path.join(ROOT, "README.md")
BLOCKS, IDS = [], []
for path in [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
    with open(path) as f:
        found = [b for b in re.findall(r"```python\n(.*?)```", f.read(), re.S)
                 if "vocab.pt" not in b]
    BLOCKS += found
    IDS += [f"{os.path.basename(path)}-{i}" for i in range(len(found))]


@pytest.mark.parametrize("code", BLOCKS, ids=IDS)
def test_readme_example(code):
    import torch
    torch._dynamo.reset()
    exec("import torch, trimpass\n" + code, {})


def test_ci_runs_the_readmes_test_command():
    with open(README) as f:
        commands = re.findall(r"```bash\n(.*?)```", f.read(), re.S)[0]
    readme = [line for line in commands.splitlines() if line and not line.startswith("#")]
    with open(os.path.join(os.path.dirname(README), ".ci", "run")) as f:
        ci = [line for line in f.read().splitlines() if line and not line.startswith(("#", "set ",
                                                                                     "cd "))]
    assert len(readme) == 2, f"the README's first bash block has {len(readme)} commands, not 2"
    assert ci == readme[1:], f".ci/run runs {ci}, the README's test command is {readme[1]!r}"


def test_the_readme_is_a_users_document_of_at_most_200_lines():
    with open(README) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/ or " \
        "bench/results/"
