"""Mutation check of the configs: each check of ``trimpass/spec/config.py`` removed in turn (a
``raise``, or a ``positive_int`` / ``probability`` / ``check_schedule`` call, replaced by ``pass``)
must make ``tests/spec/test_config.py`` fail. Not collected by pytest (about 40 s); run from the
repository root: ``.venv/bin/python tests/spec/mutate_config.py``. The file is restored after."""
import ast
import pathlib
import shutil
import subprocess
import sys
import tempfile

CONFIG = pathlib.Path("trimpass/spec/config.py")
CHECKS = ("positive_int", "probability", "check_schedule")


def checks(tree) -> list[tuple[int, int]]:
    """(first line, last line) of every check statement."""
    found = set()
    for node in ast.walk(tree):
        for block in (getattr(node, "body", None), getattr(node, "orelse", None)):
            for stmt in block if isinstance(block, list) else []:
                call = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
                    and getattr(stmt.value.func, "id", "") in CHECKS
                if isinstance(stmt, ast.Raise) or call:
                    found.add((stmt.lineno, stmt.end_lineno))
    return sorted(found)


def main() -> int:
    source = CONFIG.read_text()
    lines = source.split("\n")
    backup = pathlib.Path(tempfile.mkdtemp()) / "config.py"
    shutil.copy(CONFIG, backup)
    survived = []
    try:
        for first, last in checks(ast.parse(source)):
            mutant = list(lines)
            indent = mutant[first - 1][:len(mutant[first - 1]) - len(mutant[first - 1].lstrip())]
            mutant[first - 1:last] = [indent + "pass"]
            CONFIG.write_text("\n".join(mutant))
            run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p",
                                  "no:cacheprovider", "tests/spec/test_config.py"],
                                 capture_output=True, text=True)
            what = lines[first - 1].strip()[:70]
            print(f"line {first}: {what} -> {'killed' if run.returncode else 'SURVIVED'}")
            if run.returncode == 0:
                survived.append(first)
    finally:
        shutil.copy(backup, CONFIG)
    print(f"{len(checks(ast.parse(source)))} checks removed one at a time; survived: {survived}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
