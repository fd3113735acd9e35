"""``bench/gpu_run.sh``, the one command a GPU machine runs, refuses what it cannot do with one
line on stderr and exit 2, before installing anything: no output folder, a Python without torch,
no CUDA device (this CPU machine)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_run.sh"


def _run(args, tmp_path, python=sys.executable):
    env = dict(os.environ, PYTHON=python)
    return subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)


@pytest.mark.parametrize("args", [[], [""], ["--inject-failure"]])
def test_without_an_output_folder_it_says_so(args, tmp_path):
    done = _run(args, tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "no output folder given" in done.stderr


def test_without_torch_nothing_is_installed(tmp_path):
    done = _run([str(tmp_path / "out")], tmp_path, python="/bin/false")
    assert done.returncode == 2 and "cannot import torch; nothing installed" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_nothing_is_installed(tmp_path):
    done = _run([str(tmp_path / "out")], tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "no CUDA device" in done.stderr
    assert not (tmp_path / "out").exists()
