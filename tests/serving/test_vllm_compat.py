"""The compatibility module's record against vLLM: every recorded symbol is in the installed vLLM
with its recorded leading parameters (read from its source, and by ``inspect`` on the imported
objects), the source check names a symbol whose parameters changed, and no other module of
trimpass imports vLLM or touches a private or patched vLLM name."""
import ast
import inspect
import os

import pytest

from trimpass.serving import vllm_compat as compat
from trimpass.serving import vllm_version as vv

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "trimpass"))


def test_the_record_is_ordered_and_each_symbol_says_why():
    assert len({s.place for s in compat.SYMBOLS}) == len(compat.SYMBOLS)  # each named once
    for s in compat.SYMBOLS:
        assert s.use in ("patched", "injected", "called", "read", "written"), s
        assert ":" in s.place and s.place.startswith("vllm."), s
        if s.use in ("patched", "injected", "written"):
            assert s.meaning and s.why, s.place
    assert compat.PATCHES[0].endswith("EngineArgs.create_engine_config")  # checked first


def test_the_installed_vllm_matches_the_record():
    pytest.importorskip("vllm")
    assert vv.check_source(vv.installed_source) == []
    for s in compat.SYMBOLS:
        if s.params:
            obj = compat.resolve(s.place)
            names = list(inspect.signature(obj).parameters)
            assert names[:len(s.params)] == list(s.params), s.place
    assert vv.verdict().tested and compat.installed_version() in vv.TESTED


def _reader(changes: dict):
    """Sources from the installed vLLM, or a fake module where it is not installed, each with
    ``changes`` (old -> new text) applied."""
    def read(module):
        text = vv.installed_source(module) if compat.installed_version() else None
        if text is None:
            text = _fake(module)
        for old, new in changes.items():
            text = text.replace(old, new)
        return text
    return read


def _fake(module: str) -> str:
    """A module defining every recorded member of ``module`` with its recorded parameters."""
    classes: dict = {}
    lines = []
    for s in compat.SYMBOLS:
        if s.module != module:
            continue
        owner, _, member = s.member.partition(".")
        if not member:
            lines.append(f"def {owner}({', '.join(s.params)}): pass" if s.params else
                         f"class {owner}: pass")
            continue
        body = classes.setdefault(owner, [])
        params = ", ".join(s.params or ("self",))
        body.append(f"    def {member}({params}): pass" if s.params else f"    {member} = None")
    for owner, body in classes.items():
        lines += [f"class {owner}:", *body]
    return "\n".join(lines) + "\n"


def test_the_source_check_names_a_symbol_whose_parameters_changed():
    assert vv.check_source(_reader({})) == []
    bad = vv.check_source(_reader({"def propose_draft_token_ids(\n        self,\n        "
                                   "scheduler_output": "def propose_draft_token_ids(\n        "
                                   "self,\n        output",
                                   "def propose_draft_token_ids(self, scheduler_output":
                                   "def propose_draft_token_ids(self, output"}))
    assert len(bad) == 1 and bad[0].startswith(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids: parameters")
    renamed = vv.check_source(_reader({"self._draft_attn_layer_names = {": "self._names = {",
                                       "    _draft_attn_layer_names = None": "    _names = None"}))
    assert renamed == ["vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer."
                       "_draft_attn_layer_names: SpecDecodeBaseProposer has no "
                       "_draft_attn_layer_names"]
    gone = vv.check_source(lambda m: None if m == "vllm.logger" else _reader({})(m))
    assert gone == ["vllm.logger:init_logger: no module vllm.logger"]


def _python_files():
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(folder, f)


def test_no_other_module_imports_vllm_or_touches_its_private_or_patched_names():
    """Private vLLM names nowhere else in trimpass; patched method names nowhere else in
    trimpass.serving (elsewhere ``load_model`` or ``propose`` are trimpass's own)."""
    private = {s.member.rpartition(".")[2] for s in compat.SYMBOLS
               if s.member.rpartition(".")[2].startswith("_")}
    patched = {p.rpartition(".")[2] for p in compat.PATCHES}
    wrong = []
    for path in _python_files():
        if path.endswith(os.path.join("serving", "vllm_compat.py")):
            continue
        names = private | (patched if os.sep + "serving" + os.sep in path else set())
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm"
                                                    for a in node.names):
                wrong.append(f"{path}: import vllm")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                wrong.append(f"{path}: from {node.module}")
            elif isinstance(node, ast.Attribute) and node.attr in names:
                wrong.append(f"{path}:{node.lineno}: .{node.attr}")
    assert wrong == []


def test_the_adapter_is_named_functions_and_one_proposer_class_of_bounded_size():
    import ast
    import inspect

    from trimpass.serving import vllm_state
    from trimpass.spec.control import controller
    assert len(compat.WRAPPERS) == len(compat.PATCHES)  # one named wrapper per patched symbol
    for fn in compat.WRAPPERS:
        n = len(inspect.getsource(fn).splitlines())
        assert n <= 40, f"{fn.__name__}: {n} lines"
    for module, name in ((vllm_state, "Proposer"), (controller, "Controller")):
        cls = next(n for n in ast.walk(ast.parse(inspect.getsource(module)))
                   if isinstance(n, ast.ClassDef) and n.name == name)
        assert cls.end_lineno - cls.lineno + 1 <= 200, f"{name}: over 200 lines"
    assert not hasattr(vllm_state.Hooks, "stop") and not hasattr(controller, "StopDrafting")
