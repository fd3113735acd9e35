"""Draft trees (trimpass.spec.tree), the suffix index's best-first trees (arena.tree_vote) and the
tree verification rules (trimpass.spec.verify.walk on the device, verify.siblings as SpecInfer's
reference): every path of a tree occurs in the index after a candidate, shares are counts, nodes
come best-first; the device walk keeps exactly the path a host walk keeps; and sampled, every
emitted token is distributed as the target's, for point-mass drafts and for drafts drawn from a
distribution."""
import numpy as np
import pytest
import torch

from trimpass.spec import verify
from trimpass.spec.config import GenerateConfig, TreeConfig
from trimpass.spec.proposers.arena import Arena, tree_vote, vote
from trimpass.spec.tree import DraftTree


def test_a_tree_is_a_trie_valued_by_its_main_path_and_its_siblings_shares():
    t = DraftTree()
    a = t.add(5, -1, 0.75)
    b = t.add(6, -1, 0.25)
    c = t.add(7, a, 1.0)
    assert t.add(5, -1, 0.75) == a and len(t) == 3  # a child once
    assert t.depths() == [1, 1, 2] and t.main() == [5, 7]
    t.valued([0.8, 0.5])
    assert t.values == pytest.approx([0.8, 0.2 * (0.25 / 0.25), 0.8 * 0.5])
    assert (b, c) == (1, 2)
    lookup = DraftTree.chain([6, 9]).valued([0.9, 0.9])
    m = t.merged(lookup)
    assert m.ids == [5, 6, 7, 9] and m.parents == [-1, -1, 0, 1]
    assert m.values == pytest.approx([0.8, 0.9, 0.4, 0.81])  # a shared node keeps the higher
    best = m.best_first(3, 2)
    assert best.ids == [6, 9, 5] and best.parents == [-1, 0, -1]
    assert m.best_first(8, 1).ids == [6, 5]  # no deeper than depth 1
    ids, depth, anc = best.rows(42)
    assert ids == [42, 6, 9, 5] and depth == [0, 1, 2, 1]
    assert anc[2] == [True, True, True, False] and anc[3] == [True, False, False, True]
    assert best.confidences() == pytest.approx([0.9, 0.81 / 0.9, 0.8 / 0.81])


def _random_arena(rng, n: int, vocab: int) -> Arena:
    a = Arena()
    a.open("t")
    a.extend(rng.integers(0, vocab, n).tolist())
    return a


@pytest.mark.parametrize("seed", range(5))
def test_the_index_tree_holds_the_continuations_with_count_shares_best_first(seed):
    rng = np.random.default_rng(seed)
    arena = _random_arena(rng, 600, 4)  # a small vocabulary: long matches, many branches
    tail = arena.tokens[:arena.used]
    at, L = arena.candidates(tail, 64, end_excluded=arena.used)
    sources = [(arena, at[L == L.max()], 0)]
    tree = tree_vote(sources, 24, 6, 0.01)
    assert 1 <= len(tree) <= 24 and max(tree.depths()) <= 6
    text = arena.tokens[:arena.used].tolist()
    starts = sources[0][1].tolist()
    probs = []
    for i in range(len(tree)):
        path, n = [], i
        while n >= 0:
            path.insert(0, tree.ids[n])
            n = tree.parents[n]
        parent_path = path[:-1]
        alive = [s for s in starts if text[s:s + len(parent_path)] == parent_path]
        cont = [text[s + len(parent_path)] if s + len(parent_path) < arena.used else -1
                for s in alive]
        assert path[-1] in cont  # every path occurs after a candidate
        assert tree.shares[i] == pytest.approx(cont.count(path[-1]) / len(alive))
        p = tree.shares[i] * (probs[tree.parents[i]] if tree.parents[i] >= 0 else 1.0)
        probs.append(p)
    assert probs == sorted(probs, reverse=True)  # best-first
    chain, _ = vote(sources, 6, 0.01)
    assert tree_vote(sources, 200, 6, 0.01).main()[:len(chain)] == chain


def _host_walk(tree: DraftTree, target: list) -> list:
    """The rows the walk keeps, by a host walk from the root (row 0)."""
    children = {}
    for i, p in enumerate(tree.parents):
        children[(p + 1, tree.ids[i])] = i + 1
    path = [0]
    while (path[-1], target[path[-1]]) in children:
        path.append(children[(path[-1], target[path[-1]])])
    return path


@pytest.mark.parametrize("seed", range(20))
def test_the_device_walk_keeps_the_path_a_host_walk_keeps(seed):
    g = torch.Generator().manual_seed(seed)
    tree = DraftTree()
    for _ in range(int(torch.randint(1, 14, (1,), generator=g))):
        parent = int(torch.randint(-1, len(tree), (1,), generator=g))
        tree.add(int(torch.randint(0, 3, (1,), generator=g)), parent, 1.0)
    ids, depth, anc = tree.rows(9)
    R = len(ids) + 3  # padding rows past the tree
    pad = R - len(ids)
    target = torch.randint(0, 3, (R,), generator=g)
    anc_t = torch.zeros(R, R, dtype=torch.bool)
    anc_t[:len(ids), :len(ids)] = torch.tensor(anc)
    anc_t[range(len(ids), R), range(len(ids), R)] = True
    parent = torch.tensor([0] + [p + 1 for p in tree.parents] + [0] * pad)
    best, path = verify.walk(torch.tensor(ids + [target[0].item()] * pad), parent, anc_t,
                             torch.tensor(depth + [0] * pad), target,
                             torch.arange(R) <= len(tree))
    want = _host_walk(tree, target.tolist())
    assert int(best) == want[-1] and path[:len(want)].tolist() == want


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def test_recursive_rejection_over_siblings_emits_the_targets_distribution():
    g = torch.Generator().manual_seed(0)
    V, trials = 6, 20000
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, 0)
    qs = [torch.softmax(torch.randn(V, generator=g), 0) for _ in range(2)]
    point = torch.nn.functional.one_hot(torch.tensor(3), V).float()
    counts = torch.zeros(V)
    for _ in range(trials):  # two sampled children and one point-mass child (a lookup draft)
        drafts = [(int(torch.multinomial(q, 1, generator=g)), q) for q in qs] + [(3, point)]
        kept, token = verify.siblings(p, drafts, g)
        counts[drafts[kept][0] if kept is not None else token] += 1
    assert _tv(counts, p) < 0.02


def test_the_sampled_walk_emits_the_targets_distribution_at_each_depth():
    """The device rule (each row draws from its own target distribution; a node kept where it is
    its parent's draw): the first token is distributed as the root's p, and after a kept node the
    next as that node's p."""
    g = torch.Generator().manual_seed(1)
    V, trials = 5, 20000
    tree = DraftTree()
    for t in (0, 1, 2):
        tree.add(t, -1, 1.0)
    tree.add(3, 0, 1.0)
    ids, depth, anc = tree.rows(4)
    p = torch.softmax(torch.randn(len(ids), V, generator=g) * 2, -1)
    p[0] = torch.tensor([0.4, 0.2, 0.15, 0.15, 0.1])  # node 0 (token 0) kept often enough
    draws = torch.multinomial(p, trials, replacement=True, generator=g).T  # [trials, R]
    first, second = torch.zeros(V), torch.zeros(V)
    args = (torch.tensor(ids), torch.tensor([0] + [q + 1 for q in tree.parents]),
            torch.tensor(anc), torch.tensor(depth))
    for target in draws:
        best, path = verify.walk(*args, target, torch.ones(len(ids), dtype=torch.bool))
        n = int(args[3][best])
        emitted = [ids[r] for r in path[1:n + 1].tolist()] + [int(target[best])]
        first[emitted[0]] += 1
        if n >= 1 and path[1] == 1:  # kept node 0 (token 0): the next token is node 0's draw
            second[emitted[1]] += 1
    assert _tv(first, p[0]) < 0.02
    assert second.sum() > 1000 and _tv(second, p[1]) < 0.03


@pytest.mark.parametrize("tree, match", [
    ({"size": 0}, "tree size"), ({"size": 64}, "tree size: the loop's cache rolls back"),
    ({"depth": 1.5}, "tree depth"), ({"size": 4, "depth": 5}, "tree depth: at most size"),
    ({"width": 2}, "width"), ("yes", "tree: True, False"), ({"size": True}, "tree size")])
def test_a_bad_tree_setting_is_refused_by_name(tree, match):
    with pytest.raises(ValueError, match=match):
        GenerateConfig.of(tree=tree)


def test_a_tree_setting_widens_the_passes_rows_and_off_is_none():
    assert GenerateConfig.of(tree=False).tree is None
    assert GenerateConfig.of(tree={"size": 40}).free_tokens == 40
    assert GenerateConfig.of(tree=TreeConfig(size=8, depth=3)).free_tokens == 15
    assert GenerateConfig.of(tree=True, lookup=False, suffix=False).free_tokens == 0
