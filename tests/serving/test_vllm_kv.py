"""The shared KV cache on stand-ins for vLLM's proposer and attention metadata (no vLLM needed):
the compatibility module's next-token first pass (its wrappers of ``propose`` and
``set_inputs_first_pass``, installed on the stand-in) cuts vLLM's first-pass layout to each
request's sampled row, at its position and slot, with seq_lens = position + 1; the runner's
rejected counts reach the layout and not the later steps; a cache is shared only between layers of
the same shape (trimpass.serving.vllm_kv). The real engine runs it in
tests/serving/test_vllm_skip.py and test_vllm.py."""
import dataclasses

import pytest
import torch

from trimpass.serving import vllm_compat as compat
from trimpass.serving import vllm_kv, vllm_state

HOOKS = vllm_state.Hooks(startup=None)
WRAP = dict(zip(compat.PATCHES, compat.WRAPPERS, strict=True))


@dataclasses.dataclass
class Meta:
    """The fields of vLLM's CommonAttentionMetadata the first pass reads or writes."""
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    max_query_len: int
    causal: bool = True
    positions: torch.Tensor | None = None

    def batch_size(self) -> int:
        return len(self.query_start_loc) - 1

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


class Proposer:
    """Three requests whose target steps verified 2, 4 and 3 tokens (the last ones partly
    rejected), laid out by vLLM's first pass as each request's tokens plus its next token."""
    uses_mrope = parallel_drafting = False
    needs_extra_input_slots = True

    def __init__(self):
        self.input_ids = torch.zeros(32, dtype=torch.int32)
        self.positions = torch.zeros(32, dtype=torch.int64)
        self.seen_rejected, self.proposed_with = "unset", "unset"

    def set_inputs_first_pass(self, *, num_rejected_tokens_gpu, **kw):
        self.seen_rejected = num_rejected_tokens_gpu
        lengths, starts = [3, 5, 4], [10, 20, 7]  # rows per request, position of its first row
        ids, pos, slots, rows, at = [], [], [], [], 0
        for r, (n, p) in enumerate(zip(lengths, starts, strict=True)):
            ids += [100 * r + j for j in range(n)]
            pos += list(range(p, p + n))
            slots += [1000 * r + p + j for j in range(n)]
            at += n
            rows.append(at - 1 - int(num_rejected_tokens_gpu[r]))  # the next token's row
        total = len(ids)
        self.input_ids[:total] = torch.tensor(ids, dtype=torch.int32)
        self.positions[:total] = torch.tensor(pos)
        q = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
        cad = Meta(q, q.clone(), torch.tensor([13, 25, 11], dtype=torch.int32),
                   torch.tensor(slots), total, 5)
        return total, torch.tensor(rows, dtype=torch.int32), cad

    def propose(self, num_speculative_tokens, num_rejected_tokens_gpu=None):
        self.proposed_with = num_rejected_tokens_gpu
        return self.set_inputs_first_pass(target_token_ids=None,
                                          num_rejected_tokens_gpu=num_rejected_tokens_gpu)


def _install(cls):
    """A subclass of ``cls`` whose two methods carry the compatibility module's wrappers."""
    wrapped = {}
    for name in ("propose", "set_inputs_first_pass"):
        place = next(p for p in compat.PATCHES if p.endswith("SpecDecodeBaseProposer." + name))
        wrapped[name] = WRAP[place](HOOKS, getattr(cls, name))
    return type(cls.__name__, (cls,), wrapped)


def _shared(p):
    st = vllm_state.Proposer(None, None, True, plain=None)
    st.cache_shared = True
    vllm_state._drafters[p] = st
    return st


def test_the_first_pass_runs_each_requests_next_token_alone():
    p = _install(Proposer)()
    counts = _shared(p).shared
    rejected = torch.tensor([0, 2, 1])
    n, rows, cad = p.propose(num_speculative_tokens=3, num_rejected_tokens_gpu=rejected)
    assert p.proposed_with is None and p.seen_rejected is rejected  # applied once, in the layout
    # next tokens: request 0 its row 2 (position 12), request 1 its row 2 of 5 (position 22),
    # request 2 its row 2 of 4 (position 9)
    assert n == 3 and rows.tolist() == [0, 1, 2] and rows.dtype == torch.int32
    assert p.input_ids[:3].tolist() == [2, 102, 202]
    assert p.positions[:3].tolist() == [12, 22, 9]
    assert cad.seq_lens.tolist() == [13, 23, 10] and cad.seq_lens.dtype == torch.int32
    assert cad.slot_mapping.tolist() == [12, 1022, 2009]
    assert cad.query_start_loc.tolist() == [0, 1, 2, 3] and cad.query_start_loc_cpu.tolist() == \
        [0, 1, 2, 3]
    assert cad.num_actual_tokens == 3 and cad.max_query_len == 1 and counts["first_pass_rows"] == 3


class DynamicCausal(Proposer):
    def set_inputs_first_pass(self, **kw):
        n, rows, cad = super().set_inputs_first_pass(**kw)
        return n, rows, cad.replace(causal=torch.ones(n, dtype=torch.bool))


def test_the_first_pass_refuses_what_it_cannot_cut():
    p = _install(DynamicCausal)()
    _shared(p)
    with pytest.raises(RuntimeError, match="causal"):
        p.propose(num_speculative_tokens=3, num_rejected_tokens_gpu=torch.zeros(3))


def test_a_drafter_without_the_draft_model_layout_is_refused_at_load():
    from tests.serving.test_vllm_budget import _drafter
    p = Proposer()
    p.model = torch.nn.Linear(2, 2)
    d = dataclasses.replace(_drafter(p), target=p.model, first_pass_ok=False,
                            additional={"trim": False, "budget": {"policy": "off"}})
    with pytest.raises(RuntimeError, match="draft-model route"):
        HOOKS.loaded(p, d)


def test_a_cache_is_shared_only_between_layers_of_the_same_shape():
    cache = torch.zeros(2, 4, 8)
    assert vllm_kv.check_pairs({"draft_model.layers.0": (torch.ones(2, 4, 8), cache)}) == \
        2 * 4 * 8 * 4
    with pytest.raises(RuntimeError, match="no target layer"):
        vllm_kv.check_pairs({"draft_model.layers.1": (torch.ones(2, 4, 8), None)})
    with pytest.raises(RuntimeError, match="differ"):
        vllm_kv.check_pairs({"draft_model.layers.1": (torch.ones(2, 4, 8),
                                                      torch.zeros(2, 4, 9))})
