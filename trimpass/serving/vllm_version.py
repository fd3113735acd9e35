"""Which vLLM trimpass trims in, decided before an engine starts. :data:`TESTED` versions run every
route. Another version whose every symbol of :data:`trimpass.serving.vllm_compat.SYMBOLS` is where
the record says, with the recorded leading parameters (read from its source with :mod:`ast`,
without importing it: :func:`check_source`), is accepted with one warning naming the tested
versions, except the routes that write into the target's KV cache (the target drafting for
itself): a change of meaning there would corrupt outputs, not only drafts. A version with a
mismatch is refused, naming the symbol. ``bench/vllm_compat_check.py`` runs the same check on
another vLLM wheel's source."""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import warnings

from trimpass.config import TrimpassError
from trimpass.serving import vllm_compat as compat

TESTED = ("0.32.0",)
EXTRA_HINT = "pip install 'trimpass[vllm]'"


def _params(fn) -> list[str]:
    a = fn.args
    return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def _members(cls: ast.ClassDef) -> dict:
    """A class's members as its source defines them: method name -> its parameters, attribute
    name -> None (class-level fields, and ``self.NAME`` assigned in any method)."""
    out: dict = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = _params(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.setdefault(node.target.id, None)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, None)
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and \
                        e.value.id == "self":
                    out.setdefault(e.attr, None)
    return out


def _top(tree: ast.Module) -> dict:
    out: dict = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.setdefault(node.name, _params(node))  # the first of typing overloads
        elif isinstance(node, ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, None)
    return out


def check_source(read, symbols=compat.SYMBOLS) -> list[str]:
    """Every symbol whose source differs from the record, as ``"place: what"``; ``read(module)``
    returns a module's source text (None where there is no such module)."""
    trees: dict = {}
    out = []
    for s in symbols:
        if s.module not in trees:
            text = read(s.module)
            trees[s.module] = None if text is None else _top(ast.parse(text))
        top = trees[s.module]
        if top is None:
            out.append(f"{s.place}: no module {s.module}")
            continue
        owner, _, member = s.member.partition(".")
        got = top.get(owner, KeyError)
        if got is KeyError:
            out.append(f"{s.place}: {s.module} has no {owner}")
            continue
        if member:
            if not isinstance(got, ast.ClassDef):
                out.append(f"{s.place}: {owner} is not a class")
                continue
            members = _members(got)
            if member not in members:
                out.append(f"{s.place}: {owner} has no {member}")
                continue
            got = members[member]
        if s.params and (not isinstance(got, list) or got[:len(s.params)] != list(s.params)):
            out.append(f"{s.place}: parameters {got}, recorded {list(s.params)}")
    return out


def installed_source(module: str) -> str | None:
    """The installed module's source text, read without running it (its packages are
    imported to find it)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin) as f:
        return f.read()


@dataclasses.dataclass
class Verdict:
    version: str
    mismatches: list

    @property
    def tested(self) -> bool:
        return self.version in TESTED

    @property
    def accepted(self) -> bool:
        return not self.mismatches


_verdicts: dict = {}


def verdict(version: str | None = None, read=installed_source) -> Verdict:
    """This vLLM's verdict (the installed one unless ``version`` names another, read with
    ``read``); the check runs once per version and process, and not at all for a tested one."""
    version = version or compat.installed_version()
    if version is None:
        raise ImportError(f"trimpass.serving.vllm: trimming in vLLM needs vLLM {TESTED[-1]}; "
                          f"install the extra: {EXTRA_HINT}")
    if version not in _verdicts:
        _verdicts[version] = Verdict(version, [] if version in TESTED else check_source(read))
    return _verdicts[version]


def require(v: Verdict, *, self_drafting: bool, where: str = "trimpass") -> None:
    """Refuse (a :class:`TrimpassError` naming the symbol or the route) what ``v`` cannot run;
    warn once where it is accepted but untested."""
    tested = ", ".join(TESTED)
    if not v.accepted:
        raise TrimpassError(f"{where}: vllm {v.version} differs from what trimpass relies on: "
                            f"{v.mismatches[0]} (tested with vllm {tested}); install "
                            f"{EXTRA_HINT}, or set TRIMPASS_DISABLE=1 to serve untrimmed")
    if v.tested:
        return
    if self_drafting:
        raise TrimpassError(f"{where}: the target drafting for itself writes into the target's "
                            f"KV cache, which trimpass runs on tested vLLM versions only "
                            f"({tested}), and this is vllm {v.version}; use another drafter or "
                            f"install {EXTRA_HINT}")
    if ("warned", v.version) not in _verdicts:
        _verdicts["warned", v.version] = True
        warnings.warn(f"trimpass: vllm {v.version} is untested (tested: {tested}); every "
                      "symbol trimpass relies on matches, so trimming is on", stacklevel=2)
