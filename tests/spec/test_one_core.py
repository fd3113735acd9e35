"""One speculation core, both engines on it: the fused loop and the vLLM adapter draft lookups with
the same proposer class and decide with the same controller; every loop (the fused one, the
reference chain and tree, the training losses' simulations) verifies through the one verify
module; the engine-neutral core imports nothing of an engine, a benchmark or the diagnostics; the
runtime imports nothing of the diagnostics; no n-gram index is built outside the core's."""
import ast
import pathlib

import trimpass

ROOT = pathlib.Path(trimpass.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_both_engines_draft_with_one_proposer_each_and_decide_with_one_controller():
    from trimpass.hf import fused
    from trimpass.serving import vllm_free, vllm_state
    from trimpass.spec.control import controller
    from trimpass.spec.proposers import lookup, suffix
    assert fused.LookupProposer is lookup.LookupProposer is vllm_free.LookupProposer
    assert fused.SuffixProposer is suffix.SuffixProposer is vllm_free.SuffixProposer
    assert fused.Controller is controller.Controller is vllm_state.Controller


def test_every_loop_verifies_through_the_one_verify_module():
    from trimpass.hf import fused, rounds
    from trimpass.loops import chain, tree
    from trimpass.spec import verify
    from trimpass.train import losses
    assert all(m.verify is verify for m in (fused, rounds, chain, tree, losses))


BENEATH_THE_CORE = ("trimpass.spec", "trimpass.isotonic", "trimpass.measure")  # maths, the timer


def test_the_core_and_the_runtime_import_what_they_may():
    for path in (ROOT / "spec").rglob("*.py"):
        bad = {m for m in _imports(path) if m.startswith("trimpass.")
               and not m.startswith(BENEATH_THE_CORE)}
        assert not bad, f"{path.name} imports {bad}: spec/ stands on nothing but its maths"
    for room in ("hf", "serving", "loops", "spec"):
        for path in (ROOT / room).rglob("*.py"):
            bad = {m for m in _imports(path) if m.startswith("trimpass.diagnostics")}
            assert not bad, f"{room}/{path.name} imports {bad}: diagnostics attach by hooks"


def test_one_ngram_index():
    users = [p for p in ROOT.rglob("*.py") if "self.follow[" in p.read_text()
             or "follow: dict[tuple" in p.read_text()]
    assert [p.relative_to(ROOT).as_posix() for p in users] == ["spec/proposers/lookup.py"]
