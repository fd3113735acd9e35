"""The fused self-speculative loop behind :func:`trimpass.generate`: a Hugging Face causal LM drafts
for itself through its own trimmed head and verifies with its full head, without a second body pass.

The body (:mod:`trimpass.hf.body`: the compiled step over the loop's own static KV cache, written
at one position tensor on the device) runs one token at a time, as plain decoding does. A round's
depth ``k`` is fixed before it runs (where the drafter's confidence stopped in the last rounds,
:class:`~trimpass.hf.costs.RoundCosts`); each of its ``k`` steps drafts through the trimmed head and
a keep graph writes the hidden state, token and confidence into persistent buffers and advances the
position; one accept graph verifies the ``k`` rows with the full head, rolls the position back and
sets the next pending token (:mod:`trimpass.hf.rounds`): acceptance, rollback and sampling on the
device, with no ``multinomial``. Free drafts come from the speculation core's proposers (lookup
and the suffix index, :mod:`trimpass.spec.proposers`, this loop a batch of one), joined into one
draft tree (:mod:`trimpass.spec.tree`) and verified in one body pass padded to a row class (4, 8
or 16 rows), an ancestors-only mask through the loop's cache; the walk graph keeps the accepted
path and moves its keys and values into place. **A round reads the host once**: one packed tensor
(the kept count, the target's tokens, near-tie flags, the path or the confidence's stop depth); a
near-tie on the kept path is computed again alone, as plain decoding computes it (a rare second
read). The controller plans each round from the host values of the
last. A family whose layers the loop's cache does not serve yet
(:data:`~trimpass.hf.fused_checks.OWNED`) runs Hugging Face's assisted generation instead, with one
warning. Batch 1 only. Diagnostics (the trace and replay of a call,
:mod:`trimpass.diagnostics.replay`) attach by the body's hooks.
"""
from __future__ import annotations

import functools
import logging
import time

import torch

from trimpass import measure
from trimpass.config import disabled
from trimpass.hf.body import Body
from trimpass.hf.costs import RoundCosts
from trimpass.hf.fused_stats import FusedStats, row_classes
from trimpass.hf.rounds import METHODS, Buffers, Rounds
from trimpass.hf.sampler import Sampler
from trimpass.measure import compiled_graphs
from trimpass.spec import verify
from trimpass.spec.config import BudgetConfig, GenerateConfig
from trimpass.spec.control.controller import Controller
from trimpass.spec.control.dcut import best_prefix
from trimpass.spec.drafts import Drafts
from trimpass.spec.proposers.lookup import LookupProposer
from trimpass.spec.proposers.suffix import SuffixProposer
from trimpass.spec.tree import DraftTree

log = logging.getLogger("trimpass")


class FusedLoop:
    """The loop for one model and one :class:`GenerateConfig` (its sampling aside): its
    :class:`~trimpass.hf.body.Body` (compiled step, full head, its own static cache), its round
    graphs (:class:`~trimpass.hf.rounds.Rounds`) over persistent device buffers, its controller
    (the speculation core's, this loop a batch of one) and counters (kept on the model;
    ``model._trimpass_fused`` is the latest). ``proposer``, ``suffix_proposer``: the classes of
    the lookup and suffix-index proposers each call builds (this loop a batch of one). ``reads``:
    device-to-host reads so far."""
    proposer, suffix_proposer = LookupProposer, SuffixProposer

    def __init__(self, model, config: GenerateConfig, speculate: bool, backend, plain):
        """``backend`` compiles the drafting step (its trimmed head); ``plain`` (the inner
        compiler alone) the head-less step of plain decoding, used when ``speculate`` is False or
        trimpass is disabled, and the round graphs."""
        self.speculate = speculate and not disabled()
        self.gamma, self.confidence = config.gamma, float(config.confidence)
        self.lookup = config.lookup if self.speculate else None
        self.suffix = config.suffix if self.speculate else None
        self.tree = config.tree if self.speculate else None
        self.lookup_tokens = config.free_tokens if self.speculate else 0  # a free pass's most
        self.row_classes = row_classes(self.lookup_tokens) if self.lookup_tokens else ()
        slack = self.row_classes[-1] if self.row_classes else 0
        self.body = Body(model, self.speculate, backend, plain, slack=slack)
        self.step, self.head = self.body.step, self.body.head
        W = self.head.weight
        self.buf = Buffers(max(self.gamma, slack), W.shape[1], W.shape[0], slack, W.dtype,
                           W.device, self.confidence)
        self.rounds = Rounds(model).eval()
        self.graphs = {name: torch.compile(getattr(self.rounds, name), backend=plain,
                                           fullgraph=True) for name in METHODS}
        self.stats = FusedStats(name="fused")
        self.costs = RoundCosts(self.gamma, self.row_classes)
        deepest = max(self.gamma, self.lookup_tokens)
        free = self.lookup or self.suffix is not None
        self.controller = Controller(BudgetConfig(lookup=free).for_engine(deepest), deepest,
                                     self.costs)
        self.warmed, self.reads, self.kinds = False, 0, set()  # kinds: sampling compiled

    def warm_up(self) -> float:
        """Compile every graph a greedy call runs (the one-token step and the pass over many
        rows; each round graph at one row and at several) on a scratch request, and time the
        rounds' costs; returns the seconds it took (0 if they were compiled already)."""
        if self.warmed:
            return 0.0
        t0, graphs, body = time.perf_counter(), compiled_graphs(), self.body
        with torch.no_grad():
            self.rounds.upcast = self.stats.head_upcast = self.head.calibrate()
            rounds = self._scratch(None)
            if self.lookup_tokens:  # the rounds' first costs, each from the same cache length
                own = len(rounds) - len(self.row_classes)
                one, deep, *passes = (measure.best_ms(lambda r=r: (body.rollback(2), r())) / 1e3
                                      for r in (rounds[0], rounds[own - 1], *rounds[own:]))
                step = (deep - one) / (self.gamma - 1) if self.gamma > 1 else one / 2
                self.costs.time("step_s", max(step, 1e-6))
                self.costs.time("head_s", max(one - step, 1e-6))
                for rows, seconds in zip(self.row_classes, passes, strict=True):
                    self.costs.time_pass(rows, seconds)
        upcast, self.warmed = self.stats.head_upcast, True
        self.stats = s = FusedStats(name="fused", head_upcast=upcast)  # scratch rounds uncounted
        self.costs.restart()  # the scratch rounds' stops forgotten
        s.warm_up_s, s.graphs = time.perf_counter() - t0, compiled_graphs() - graphs
        s.body_upcast = body.rows.rewritten
        log.info("trimpass.generate: compiled %d graphs in %.1f s (first call on this model and "
                 "setting; none later)", s.graphs, s.warm_up_s)
        return s.warm_up_s

    def _scratch(self, sampler) -> list:
        """Every round this loop runs with ``sampler``'s kind of sampling, once, on a scratch
        request (its graphs compiled); returns the rounds, to be run again (from position 2)."""
        body, kind = self.body, tuple(self._flags(sampler).values())
        if sampler is not None:
            self.buf.warp.copy_(sampler.values(self.head.weight.shape[0]))
        body.fresh_cache(2, max(self.gamma, 2) + 1)
        V = self.head.weight.shape[0]  # ordinary ids, none of the special ones up front
        ids = (V // 4 + torch.arange(2 + self.lookup_tokens, device=body.device)) % V
        token = int(ids[1])  # the scratch prompt's last: the free rounds' pending one
        self._first(body.prefill(ids[None, :2])[0], sampler)
        rounds = [lambda: self._plain(sampler)] if not self.speculate else \
            [lambda k=k: self._self_round(0, k, 2, sampler) for k in sorted({1, self.gamma})]
        rounds += [lambda S=S: self._tree_round(token, DraftTree.chain(ids[2:S + 1].tolist()), 2,
                                                sampler) for S in self.row_classes]
        for run in rounds:
            body.rollback(2)
            run()
        body.reset_rows()  # the scratch request's ids leave nothing behind
        self.kinds.add(kind)
        return rounds

    def _read(self, t: torch.Tensor) -> list:
        """A device-to-host read: one a round, one more at a near-tie."""
        self.reads += 1
        return t.tolist()

    @staticmethod
    def _flags(sampler) -> dict:
        return dict(sampled=sampler is not None, top_k=sampler is not None and sampler.top_k,
                    top_p=sampler is not None and sampler.top_p)

    def _accept(self, H, D, m, drafts: int, sampler, at: int):
        """Verify ``H`` [R, d] against ``D`` [R] (its first ``drafts`` rows drafted tokens) on the
        device, read the packed result once, recheck near-ties alone; (emitted ids, kept n, the
        drafter's stop depth, the drafted ids)."""
        b, R = self.buf, H.shape[0]
        C, Q = b.C[:R], b.Q[:R]
        for t in (H, D, C, Q) if R > 1 else ():
            torch._dynamo.maybe_mark_dynamic(t, 0)
        packed = self.graphs["accept"](H, D, C, Q, m, b.tok, self.body.cache.pos, b.j, b.warp,
                                       b.confidence, **self._flags(sampler))
        v = self._read(packed)
        n, stop, ties, ids, d = v[0], v[1], v[2:2 + R], v[2 + R:2 + 2 * R], v[2 + 2 * R:]
        if any(ties[:n + 1]) and sampler is None:
            n = self._recheck(H, ids, d[:drafts], ties, at)
        return d[:n] + ([ids[n]] if n < R else []), n, stop, d[:drafts]

    def _recheck(self, H, ids: list, d: list, ties: list, at: int) -> int:
        """Each near-tie row up to the first disagreement computed again alone, as plain decoding
        computes it (a rare second read); the pending token and position set to match."""
        for j in (j for j, t in enumerate(ties) if t):
            if j > verify.agreed(ids, d):
                break
            ids[j] = self._alone(H[j:j + 1])
        n = verify.agreed(ids, d)
        new = d[:n] + ([ids[n]] if n < len(ids) else [])
        self.buf.tok.fill_(new[-1])
        self.body.cache.seek(at + len(new))
        return n

    def _self_round(self, token: int, k: int, at: int, sampler):
        """``k`` drafting steps from the pending ``token`` at position ``at`` through the trimmed
        head, each followed by the keep graph, then the accept graph over their rows; (emitted
        ids, kept n, the confidence's stop depth, the drafted ids)."""
        b, pos = self.buf, self.body.cache.pos
        for _ in range(k):
            h, z = self.body.here(b.tok)[1:]
            self.graphs["keep"](h, z, b.H, b.D, b.C, b.Q, b.j, b.tok, pos, b.warp,
                                sampler is not None)
        out = self._accept(b.H[:k], b.D[:k], k, k, sampler, at)
        for j, t in enumerate([token] + out[3][:k - 1] if self.body.hooks else []):
            self.body.tell("on_pass", at + j, torch.tensor([[t]]))  # diagnostics, once read
        return out

    def _tree_round(self, token: int, tree: DraftTree, at: int, sampler):
        """Verify a free draft ``tree`` (a chain is one) after the pending ``token`` at ``at`` in
        one body pass padded to a row class (:meth:`Rounds.walk
        <trimpass.hf.rounds.Rounds.walk>`); (emitted ids, kept n)."""
        b, m = self.buf, len(tree)
        S = next(s for s in self.row_classes if s >= m + 1)
        ids, depth, anc = tree.rows(token)
        pad = S - m - 1
        anc = [row + [False] * pad for row in anc] + \
            [[k == i for k in range(S)] for i in range(m + 1, S)]  # padding sees itself
        b.pack_tree(m, ids + [0] * pad, depth + [0] * pad,
                    [0] + [p + 1 for p in tree.parents] + [0] * pad, anc)
        count, rows, deep, parent, seen = b.tree_views(S)
        hs = self.body.tree(rows.view(1, S), deep, seen)
        for t in (hs, rows, parent, deep, seen):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        kv = [t for layer in self.body.cache.layers for t in (layer.keys, layer.values)]
        packed = self.graphs["walk"](hs, rows, parent, seen, deep, count, kv, b.tok,
                                     self.body.cache.pos, b.warp, **self._flags(sampler))
        v = self._read(packed)
        n, path, ties, target = v[0], v[2:2 + S], v[2 + S:2 + 2 * S], v[2 + 2 * S:]
        if sampler is None and any(ties[r] for r in path[:n + 1]):
            n = self._recheck_path(hs, path, n, ties, target, at)
        out = [ids[r] for r in path[1:n + 1]] + [target[path[n]]]
        if self.body.hooks:  # diagnostics: the pass and the path it kept
            self.body.tell("on_tree", at, torch.tensor([ids + [0] * pad]), torch.tensor(
                depth + [0] * pad), torch.tensor(anc, dtype=torch.long), path[:n + 1])
        return out, n

    def _recheck_path(self, hs, path: list, n: int, ties: list, target: list, at: int) -> int:
        """A tree pass's near-tie rows on its kept path computed again alone, as plain decoding
        computes them (a rare second read); where one changes, the path ends there with the
        token computed alone, and the pending token and position follow. Returns the kept
        count."""
        for k, r in enumerate(path[:n + 1]):
            if not ties[r]:
                continue
            t = self._alone(hs[r:r + 1])
            if t != target[r]:
                target[r], n = t, k
                self.buf.tok.fill_(t)
                self.body.cache.seek(at + k + 1)
                break
        return n

    def _alone(self, h) -> int:
        """The full head's greedy token from one row alone; the loop's state untouched."""
        scratch = (self.buf.tok.clone(), self.body.cache.pos.clone())
        self.stats.rechecks += 1
        return self._read(self.graphs["token"](h.clone(), *scratch, self.buf.warp, advance=False,
                                               **self._flags(None)))[0]

    def _plain(self, sampler, token: int = 0, at: int = 0) -> list[int]:
        """Plain decoding's step (the pending ``token`` at ``at``) through the same compiled body:
        one token, one read."""
        if self.body.hooks:  # diagnostics
            self.body.tell("on_pass", at, torch.tensor([[token]]))
        return self._first(self.body.here(self.buf.tok)[1], sampler, advance=True)

    def _first(self, h, sampler, advance: bool = False) -> list[int]:
        """The full head's own token from one hidden state (the prompt's last, plain
        decoding's), made the pending one."""
        self.stats.verifications += 1
        self.stats.body_steps += advance
        b = self.buf
        return self._read(self.graphs["token"](h, b.tok, self.body.cache.pos, b.warp,
                                               advance=advance, **self._flags(sampler)))

    def _next(self, text: list[int], new: list[int], budget: int, sampler, proposers) -> list[int]:
        """One round after ``text`` (its last ``new`` tokens emitted last round), as the
        controller plans it: a free round (depth 0: the free drafts as one tree, or the better
        priced chain) where it is worth more tokens per second than a trimmed self-draft of the
        depth the loop's recent stops chose, else that self-draft; each round is timed for the
        costs, and every draft offered is priced against what the round emitted."""
        t0, token, at = time.perf_counter(), text[-1], len(text) - 1
        if not self.speculate:
            return self._plain(sampler, token, at)
        offered = [p.draft([0], [len(text) - len(new)], lambda i, a, b: text[a:b], [new],
                           budget - 1) for p in proposers] if budget > 1 else []
        look = self.controller.prices.choose(*offered)
        tree = self._tree(offered, proposers, budget) if look is not None and self.tree else None
        priced = look if tree is None else Drafts.of(
            [tree.ids], look.source[0], [look.match[0]], confidence=tree.confidences(),
            parents=tree.parents)
        k = min(self.costs.depth(self.gamma, self.confidence), budget)
        plan = self.controller.plan(1, self.gamma, priced, depths=(k,) if look is None else (0, k))
        sent = None
        if look is not None and not plan.depth:
            sent = look.source[0]
            draft = DraftTree.chain(look.row(0)) if tree is None else tree.prefix(self._size(tree))
            out, n = self._tree_round(token, draft, at, sampler)
            self.costs.time_pass(len(draft) + 1, time.perf_counter() - t0)
            self.stats.counted(len(draft), n, sent)
            self.stats.tree_rounds += draft.parents != list(range(-1, len(draft) - 1))
            self.stats.branch_kept += n - verify.agreed(out, draft.main())
        else:
            out, n, stop, d = self._self_round(token, k, at, sampler)
            self.costs.self_round(k, time.perf_counter() - t0)
            self.costs.stopped(stop)
            self.stats.counted(k, n, "self")
            self.controller.offer(0, "self", d, k)
        for free in (f for f in offered if f.counts[0]):
            source = free.source[0]
            sends = source == sent or (sent is not None and tree is not None)
            self.controller.offer(0, source, free.row(0), free.counts[0] * sends,
                                  match=free.match[0])
        self.controller.observe([0], [out])
        return out

    def _tree(self, offered: list, proposers: list, budget: int) -> DraftTree:
        """This round's free drafts as one tree: the suffix index's every continuation and the
        lookup draft, each node valued from its source's price record (its acceptance by
        depth) and its share among its siblings; the ``tree.size`` best, best-first."""
        deep, trees = min(self.tree.depth, budget - 1), []
        for drafts, proposer in zip(offered, proposers, strict=True):
            if drafts.counts[0]:
                grown = proposer.tree(0, self.tree.size, deep) if hasattr(proposer, "tree") \
                    else DraftTree.chain(drafts.row(0))
                trees.append(self.controller.prices.valued(grown, drafts.source[0],
                                                           drafts.match[0]))
        return functools.reduce(DraftTree.merged, trees).best_first(self.tree.size, deep)

    def _size(self, tree: DraftTree) -> int:
        """How many of a best-first ``tree``'s nodes to verify: the prefix of best expected
        tokens per second by the passes' measured costs (D-Cut's rule over the nodes' values)."""
        priced = self.costs.price(1, 0)
        if priced is None:
            return len(tree)
        return best_prefix(tree.confidences(), priced[0])

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens, sampler: Sampler | None, eos: set[int],
                 outputs=None, store=None, tenant: str = "", suffix=None) -> torch.Tensor:
        """Decode one request; ``outputs``: an :class:`~trimpass.hf.output_cache.OutputCache`
        beside the lookup drafts; ``store``: the suffix index's earlier outputs
        (:class:`~trimpass.spec.proposers.suffix.SuffixStore`), read and kept under ``tenant``;
        ``suffix``: this call's suffix-index settings (None: the loop's)."""
        self.warm_up()
        if sampler is not None and tuple(self._flags(sampler).values()) not in self.kinds:
            stats, self.stats = self.stats, FusedStats(name="fused")
            self._scratch(sampler)  # this kind of sampling's graphs, before the request
            self.stats = stats  # its scratch rounds uncounted
        self.body.reset_rows()
        P = input_ids.shape[1]
        self.body.tell("on_request", P, max_new_tokens)
        self.body.fresh_cache(P, max_new_tokens)
        if sampler is not None:
            self.buf.warp.copy_(sampler.values(self.head.weight.shape[0]))
        text = input_ids[0].tolist()
        text += self._first(self.body.prefill(input_ids.to(self.body.device))[0], sampler)
        proposers = [self.proposer(self.lookup, outputs)] if self.lookup is not None else []
        suffix = suffix or self.suffix
        suffix = self.suffix_proposer(suffix, store, tenant) if self.suffix is not None else None
        proposers += [suffix] if suffix is not None else []
        self.controller.forget("lookup")  # the text's repeats are its own; the model's stay
        new = text[P:]
        while len(text) - P < max_new_tokens and not eos.intersection(new):
            new = self._next(text, new, max_new_tokens - (len(text) - P), sampler, proposers)
            self.body.tell("on_rollback", len(text) + len(new) - 1)
            text += new
        out = through_eos(text[P:], eos)
        self.stats.emitted += len(out)
        if outputs is not None:
            outputs.add(out)
        if suffix is not None:
            suffix.finish(0, out)
        tail = torch.tensor([out], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, tail], dim=1)


def through_eos(ids: list[int], eos: set[int]) -> list[int]:
    """``ids`` up to and with their first EOS (a round may emit tokens past it)."""
    return next((ids[:i + 1] for i, t in enumerate(ids) if t in eos), ids)


def eos_ids(model) -> set[int]:
    e = getattr(model.generation_config, "eos_token_id", None)
    return set() if e is None else {int(x) for x in (e if isinstance(e, (list, tuple)) else [e])}
