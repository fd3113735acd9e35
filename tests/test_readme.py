"""The README's usage examples run as written (those that need no file of the user's)."""
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")
with open(README) as f:
    BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", f.read(), re.S) if "vocab.pt" not in b]


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example(code):
    import torch
    torch._dynamo.reset()
    exec("import torch, trimpass\n" + code, {})
