#!/usr/bin/env bash
# The GPU check as one command, for a CUDA machine that has torch and triton but no package
# registry: builds trimpass's wheel from this tree and installs it with no registry and no
# dependencies, then runs bench/gpu_check.py from the installed package, its output unbuffered and
# teed into OUTDIR/gpu_check.log; gpu_check rewrites OUTDIR/gpu_check.json after every section,
# with each section's seconds. Exit status: gpu_check's (0 all passed, 1 a check failed); 2 with no
# OUTDIR, no torch, or no CUDA device (a one-line error, nothing installed); 3 if the install
# failed. Python: $PYTHON, else python3.
# Usage: bench/gpu_run.sh OUTDIR [gpu_check options, e.g. --inject-failure]
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [ $# -lt 1 ] || [ -z "$1" ] || [[ "$1" == -* ]]; then
    echo "gpu_run.sh: no output folder given; usage: bench/gpu_run.sh OUTDIR" >&2
    exit 2
fi
out=$1
shift
if ! cuda=$("$py" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null); then
    echo "gpu_run.sh: $py cannot import torch; nothing installed" >&2
    exit 2
fi
if [ "$cuda" != 1 ]; then
    echo "gpu_run.sh: no CUDA device visible to $py's torch; nothing installed (on a CPU:" \
         "python bench/gpu_check.py --dry-run)" >&2
    exit 2
fi
mkdir -p "$out"
wheels=$(mktemp -d)
rm -rf build  # setuptools' own staging folder: a stale one would put old files in the wheel
if ! { "$py" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$wheels" . \
        && "$py" -m pip install -q --no-deps --no-index --force-reinstall "$wheels"/trimpass-*.whl
     } > "$out/install.log" 2>&1; then
    echo "gpu_run.sh: installing the wheel failed; see $out/install.log" >&2
    tail -5 "$out/install.log" >&2
    exit 3
fi
PYTHONUNBUFFERED=1 "$py" -u bench/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
