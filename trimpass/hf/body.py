"""The fused loop's body: a Hugging Face causal LM's body compiled as one step (its trimmed head
included when it drafts, ``fullgraph=True``), over the loop's own static KV cache
(:class:`~trimpass.hf.buckets.LoopCache`): every layer full length, writing at one position tensor
on the device that the loop's round graphs move, so a rollback is a device-side update; the cache of
each capacity class is kept for the next request of its class. The prompt is prefilled in passes
whose row count is dynamic, and the cache's length is dynamic in the compiled graphs, so the first
call compiles both graphs the body runs and no later prompt compiles another
(:mod:`trimpass.hf.buckets`). ``hooks`` hear of each new request, rollback, pass and tree pass
(diagnostics: :mod:`trimpass.diagnostics.replay`); the body reads nothing back."""
from __future__ import annotations

import contextlib

import torch

from trimpass.hf import buckets, upcast
from trimpass.hf.buckets import LoopCache
from trimpass.hf.full_head import FullHead
from trimpass.hf.step import Step


class Body:
    """``model``'s compiled step (through ``backend`` with its trimmed head when ``speculate``,
    else head-less through ``plain``, the inner compiler alone), its full head and its cache."""

    def __init__(self, model, speculate: bool, backend, plain, slack: int = 0):
        self.model, self.speculate, self.backend = model, speculate, backend
        self.step = Step(model, head=speculate).eval()
        # several rows' linears upcast where this CPU multiplies half precision slowly
        self.rows = upcast.RowsBackend(backend if speculate else plain,
                                       model.get_output_embeddings().weight.shape)
        self.step.compile(backend=self.rows, fullgraph=True)
        self.tree_graph = torch.compile(self.step.tree, backend=self.rows, fullgraph=True)
        self.head = FullHead(model)
        self.device = self.head.weight.device
        self.cache, self.capacity, self.context = None, 0, buckets.context_of(model)
        self.caches: dict[int, LoopCache] = {}  # capacity class -> its cache, oldest first
        # rows past a cache's capacity that a padded pass (a free draft's, a prompt's) may write
        self.slack = max(slack, buckets.padded_rows(1, self.device) - 1)
        self.hooks: list = []  # objects with on_request / on_rollback / on_pass, any of them

    def tell(self, event: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, event, lambda *a: None)(*args)

    @contextlib.contextmanager
    def quiet(self):
        """Body passes that no hook hears of (a diagnostic's own computation)."""
        kept, self.hooks = self.hooks, []
        try:
            yield
        finally:
            self.hooks = kept

    def fresh_cache(self, prompt: int, new: int) -> LoopCache:
        """The cache for a prompt of ``prompt`` tokens and ``new`` more, at position 0: its
        capacity class's (:func:`~trimpass.hf.buckets.capacity_for`), kept for the next request of
        that class where graphs are recorded (:func:`~trimpass.hf.buckets.kept_classes`), so a new
        prompt never means a new cache's addresses in a recorded graph."""
        capacity = buckets.capacity_for(prompt + new, self.context, self.device)
        if capacity not in self.caches:
            while len(self.caches) >= buckets.kept_classes(self.device):  # the oldest's first
                self.caches.pop(next(iter(self.caches)))
            self.caches[capacity] = LoopCache(self.model, capacity, self.slack)
        self.caches[capacity] = self.caches.pop(capacity)  # the most recent last
        self.cache, self.capacity = self.caches[capacity], capacity
        self.rollback(0)
        return self.cache

    def rollback(self, length: int) -> None:
        """Set the position from the host (a prompt's chunk, a diagnostic replay): a round's
        rollback is the accept graph's, on the device."""
        self.tell("on_rollback", length)
        self.cache.seek(length)

    def here(self, ids: torch.Tensor):
        """One body pass over ``ids[1, n]`` (a device tensor) at the cache's position, which it
        leaves where it was: every row's hidden state, the last row's, and its trimmed logits. One
        token runs the one-token step's graph; more run one graph whose row count is dynamic (a
        prompt's chunk, a lookup verification)."""
        if ids.shape[1] > 1:
            torch._dynamo.maybe_mark_dynamic(ids, 1)
        out = self.step(ids, self.cache)
        state = self.backend.state_for(self.step) if self.speculate else None
        if state is not None:
            state.upkeep()  # a replayed step runs none of the state's Python
        return out

    def tree(self, ids: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
        """One pass over a draft tree's rows at the cache's position (:meth:`Step.tree
        <trimpass.hf.step.Step.tree>`), which it leaves where it was: every row's hidden state.
        One graph for every row count."""
        for t, dims in ((ids, (1,)), (depth, (0,)), (anc, (0, 1))):
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
        return self.tree_graph(ids, self.cache, depth, anc)

    def keep_path(self, at: int, path: list[int]) -> None:
        """Move a tree pass's kept rows (``path``, by depth) to the positions after ``at`` in every
        layer, as the walk graph does (a diagnostic replay's)."""
        src = torch.tensor(path, device=self.device) + at
        dst = torch.arange(len(path), device=self.device) + at
        for layer in self.cache.layers:
            for t in (layer.keys, layer.values):
                t.index_copy_(2, dst, t.index_select(2, src))

    def run(self, ids: torch.Tensor, at: int):
        """:meth:`here` from position ``at`` (set from the host)."""
        # a slice of a longer prompt keeps that prompt's row stride, and Dynamo guards on strides
        ids = torch.empty_like(ids, memory_format=torch.contiguous_format).copy_(ids)
        self.cache.seek(at)
        self.tell("on_pass", at, ids)
        return self.here(ids.to(self.device))

    def prefill(self, ids: torch.Tensor):
        """The prompt in passes of up to ``buckets.CHUNK`` tokens, each padded to
        :func:`~trimpass.hf.buckets.padded_rows` (its last id repeated, written past the prompt
        and never read); returns the last real row's (h, trimmed logits: None where padded), the
        cache's position at the prompt's end."""
        for start in range(0, ids.shape[1], buckets.CHUNK):
            chunk = ids[:, start:start + buckets.CHUNK]
            n = chunk.shape[1]
            rows = buckets.padded_rows(n, self.device)
            if rows > n:
                chunk = torch.cat([chunk, chunk[:, -1:].expand(1, rows - n)], dim=1)
            hs, h, z = self.run(chunk, start)
            if rows > n:
                h, z = hs[n - 1:n], None
        self.rollback(ids.shape[1])
        return h, z

    def reset_rows(self) -> None:
        """A new request in the trimmed head's state: its context ids, not the last one's."""
        state = self.backend.state_for(self.step) if self.speculate else None
        if state is not None and state.V is not None:
            state.reset()
