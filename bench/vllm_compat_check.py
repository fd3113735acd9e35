"""Check another vLLM wheel's source against trimpass's record of what it relies on, without
installing or importing it (not a CI step):

    pip download --no-deps vllm==0.33.0 -d /tmp/vllm033
    .venv/bin/python bench/vllm_compat_check.py /tmp/vllm033/vllm-0.33.0-*.whl

Reads each module of ``trimpass.serving.vllm_compat.SYMBOLS`` out of the wheel (a zip), parses it
with ``ast`` and compares every recorded class, method, leading parameters and attribute
(``trimpass.serving.vllm_version.check_source``). Prints one line per symbol that differs and the
verdict trimpass would give that version; exit status 1 when it would be refused."""
from __future__ import annotations

import argparse
import re
import sys
import zipfile

from trimpass.serving import vllm_compat, vllm_version


def wheel_reader(path: str):
    z = zipfile.ZipFile(path)
    names = set(z.namelist())

    def read(module: str) -> str | None:
        base = module.replace(".", "/")
        for name in (f"{base}.py", f"{base}/__init__.py"):
            if name in names:
                return z.read(name).decode()
        return None
    return read


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheel", help="a vLLM wheel (.whl)")
    a = p.parse_args(argv)
    m = re.search(r"vllm(?:_cpu)?-([0-9][^-]*)-", a.wheel.rsplit("/", 1)[-1])
    version = m.group(1) if m else "unknown"
    bad = vllm_version.check_source(wheel_reader(a.wheel))
    n = len(vllm_compat.SYMBOLS)
    print(f"vllm {version}: {n - len(bad)} of {n} recorded symbols match "
          f"({len(vllm_compat.PATCHES)} patched)")
    for line in bad:
        print(f"  differs: {line}")
    v = vllm_version.Verdict(version, bad)
    if v.tested:
        print("verdict: tested")
    elif v.accepted:
        print(f"verdict: accepted with a warning (tested: {', '.join(vllm_version.TESTED)}); the "
              "target drafting for itself (its KV cache shared) refused")
    else:
        print(f"verdict: refused, naming {bad[0].split(':', 2)[0]}:{bad[0].split(':', 2)[1]}")
    return 0 if v.accepted else 1


if __name__ == "__main__":
    sys.exit(main())
