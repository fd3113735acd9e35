"""Installed as users install it: the wheel built from a copy of the tree (no editable install)
holds every package folder and the shipped weights, and, installed with ``--no-deps`` into a fresh
virtual environment that borrows this one's site packages (torch, transformers, ...) but not its
editable trimpass, from a working directory outside the tree: ``trimpass`` is the installed copy,
every module of the package imports, and ``trimpass.generate`` runs its trimmed head on a tiny
random model, equal to plain decoding. ``pip install -e`` (what ``tests/run`` does) serves every
folder of the tree whatever the package list says, so only this test sees a folder left out."""
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "trimpass", "kernels")  # what the build reads

# run inside the fresh venv, from a folder outside the tree
CHECK = textwrap.dedent("""
    import importlib, os, pkgutil, sys, traceback
    import torch, trimpass
    venv = os.path.realpath(sys.prefix)
    assert os.path.realpath(trimpass.__file__).startswith(venv + os.sep), (
        f"trimpass imported from {trimpass.__file__}, not from the venv {venv}")
    broken, optional = [], []
    for m in pkgutil.walk_packages(trimpass.__path__, "trimpass.", onerror=broken.append):
        try:
            importlib.import_module(m.name)
        except ImportError as e:
            if (e.name or "").split(".")[0] in ("trimpass", ""):
                broken.append(f"{m.name}: {e!r}")
            else:
                optional.append(f"{m.name} needs {e.name}")
        except Exception:
            broken.append(f"{m.name}: {traceback.format_exc(limit=1)}")
    assert not broken, "modules that do not import from the wheel: " + "; ".join(broken)
    print("optional:", optional)
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=301, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16)
    model = Gemma3ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 301, (1, 9))
    with torch.no_grad():
        out = trimpass.generate(model, ids, 7, inner="aot_eager", lookup=False)
        ran = trimpass.stats(model)["trimmed_calls"]
        plain = trimpass.generate(model, ids, 7, speculate=False, inner="aot_eager")
    assert ran > 0, "the trimmed head did not run"
    assert torch.equal(out, plain), (out, plain)
    print("modules:", len(list(pkgutil.walk_packages(trimpass.__path__, "trimpass."))))
    print("generate: ok", ran)
""")


def _package_dirs() -> set[str]:
    """The tree's package folders, as import paths (``kernels/`` installs as trimpass.kernels)."""
    found = set()
    for top, name in (("trimpass", "trimpass"), ("kernels", "trimpass.kernels")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((name, *rel)))
    return found


def _build(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:  # a copy: setuptools' build/ folder in the tree could serve stale files
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, capture_output=True, text=True)
    (wheel,) = (tmp / "dist").glob("trimpass-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", minversion="68")
    return _build(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_every_package_folder_and_the_weights(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    packaged = {n.rsplit("/", 1)[0].replace("/", ".") for n in names
                if n.endswith("/__init__.py")}
    missing = _package_dirs() - packaged
    assert not missing, f"package folders left out of the wheel: {sorted(missing)}"
    shipped = [p.relative_to(ROOT).as_posix() for p in (ROOT / "trimpass").rglob("*.safetensors")]
    assert shipped and set(shipped) <= set(names), (shipped, "not all in the wheel")


def test_the_installed_wheel_imports_every_module_and_generates(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True, text=True)
    # this venv's packages, as a plain path: its .pth files (the editable finder) are not read
    borrowed = sysconfig.get_paths()["purelib"]
    Path(site.stdout.strip(), "borrowed.pth").write_text(borrowed + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(py), "-c", CHECK], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "generate: ok" in done.stdout, done.stdout
