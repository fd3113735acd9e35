"""The import graph of ``trimpass`` and ``kernels`` (imports inside functions counted too) has no
cycle, every import points down the floors of ``docs/architecture.md``, ``kernels`` imports
nothing of trimpass but its bottom module ``trimpass.base``, and no module uses another's private
name."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"trimpass": os.path.join(ROOT, "trimpass"), "trimpass.kernels": os.path.join(ROOT,
                                                                                          "kernels")}


# A unit (a top-level module or package of trimpass) imports only units on lower floors; inside a
# unit, only the no-cycle rule holds. A new unit gets its floor here, where docs/architecture.md
# says it belongs. select/, train/, testing/ and headbench sit beside the core, above everything a
# compiled step runs, so nothing of the step imports them.
FLOORS = {
    "base": 0, "shapes": 0, "vocab": 0, "cache": 0, "progress": 0, "isotonic": 0, "lowrank": 0,
    "dtypes": 0,
    "kernels": 1, "measure": 1, "config": 1,
    "compact": 2, "spec": 2,
    "ops": 3, "loops": 3,
    "dynamic": 4, "hf": 4,
    "graph": 5, "models": 5,
    "backend": 6,
    "serving": 7, "headbench": 7,
    "select": 8, "testing": 8, "diagnostics": 8,
    "train": 9,
    "trimpass": 10,
    "demo": 11,
    "__main__": 12,
}


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def modules() -> dict[str, str]:
    """{dotted module name: file path} of every module of the two packages."""
    found = {}
    for pkg, top in PACKAGES.items():
        for folder, _, files in os.walk(top):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(folder, f), top)[:-3].replace(os.sep, ".")
                name = pkg if rel == "__init__" else f"{pkg}.{rel.removesuffix('.__init__')}"
                if name.startswith("trimpass.kernels") and pkg == "trimpass":
                    continue
                found[name] = os.path.join(folder, f)
    return found


def imports(name: str, path: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` imports anywhere in its file (a package's
    ``__init__`` is not counted for a submodule imported from it)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    with open(path) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_every_import_points_down_the_floors():
    wrong = []
    for name, deps in graph().items():
        u = unit(name)
        assert u in FLOORS, f"{name}: unit {u!r} has no floor; add it to FLOORS (and the docs)"
        for d in deps:
            if unit(d) != u and FLOORS[unit(d)] >= FLOORS[u]:
                wrong.append(f"{name} (floor {FLOORS[u]}) imports {d} (floor {FLOORS[unit(d)]})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_kernels_import_only_the_bottom_module():
    for name, deps in graph().items():
        if name.startswith("trimpass.kernels"):
            above = {d for d in deps if not d.startswith(("trimpass.kernels", "trimpass.base"))}
            assert not above, f"{name} imports {sorted(above)}"


def private_uses() -> list[str]:
    """``from m import _x`` or ``m._x`` in one module of the packages for a ``_x`` of another."""
    mods, found = modules(), []
    for name, path in sorted(mods.items()):
        with open(path) as f:
            tree = ast.parse(f.read())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trimpass"):
                for a in node.names:
                    if f"{node.module}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{name}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names
                                if a.name in mods and a.asname})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and aliases.get(node.value.id, name) != name and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                found.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_is_used_outside_its_module():
    found = private_uses()
    assert not found, "private names used across modules:\n" + "\n".join(sorted(set(found)))
