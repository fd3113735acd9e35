"""Every vLLM symbol trimpass touches, named once, with what it relies on and why; the only module
of trimpass that imports vLLM or reads a vLLM attribute. :data:`SYMBOLS` records each one: its
place (``module:Class.member``), the leading parameters relied on for a method, what trimpass does
with it (``patched``: one class-level wrapper, installed once by :func:`install` in the order of
:data:`PATCHES`; ``injected``: a method added to the class; ``called``; ``read``; ``written``), its
meaning and the reason. :mod:`trimpass.serving.vllm_version` checks the installed vLLM, or another
wheel's source, against the record. The wrappers below take values out of vLLM's objects and hand
them to the hooks (:class:`trimpass.serving.vllm_state.Hooks`), which keep every trimpass state in
trimpass's own registry: no trimpass attribute is set on a vLLM object. Why patches remain in
0.32: a custom logits processor is refused with speculative decoding (and runs on the target's
logits, not the drafter's), and the ``custom_class`` proposer is called with the sampled tokens and
the batch's token array only, without request ids (rows cannot follow requests) or the KV cache
(the target cannot draft on its own cache), so neither removes a patch."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import time

import torch


@dataclasses.dataclass(frozen=True)
class Symbol:
    place: str  # "module:Class.member" or "module:function"
    use: str  # patched | injected | called | read | written
    params: tuple = ()  # a method's leading parameters, in order, that trimpass relies on
    meaning: str = ""
    why: str = ""

    @property
    def module(self) -> str:
        return self.place.partition(":")[0]

    @property
    def member(self) -> str:
        return self.place.partition(":")[2]


_R = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_P = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
_LP = "vllm.model_executor.layers.logits_processor:LogitsProcessor"
_VE = "vllm.model_executor.layers.vocab_parallel_embedding"
_SO = "vllm.v1.core.sched.output:SchedulerOutput"
_CAD = "vllm.v1.attention.backend:CommonAttentionMetadata"
_IB = "vllm.v1.worker.gpu_input_batch:InputBatch"

SYMBOLS = (
    # ---- patched: one class-level wrapper each, in the order install() applies them -----------
    Symbol("vllm.engine.arg_utils:EngineArgs.create_engine_config", "patched", ("self",),
           "builds the engine's configuration in the process that parses the arguments",
           "the start-up check refuses bad trimpass settings before any engine process starts"),
    Symbol(f"{_P}.load_model", "patched", ("self", "target_model"),
           "loads the drafter next to the target model",
           "a drafter's trimpass state (rows, trimmed head, budget, KV sharing) is built once its "
           "model exists; a bad setting fails the engine's start, not a request"),
    Symbol(f"{_R}.initialize_kv_cache_tensors", "patched", ("self", "kv_cache_config"),
           "allocates every attention layer's KV cache, before CUDA graphs are captured",
           "the target drafting for itself points its drafter layers at the target's caches "
           "before any graph captures the drafter's own"),
    Symbol(f"{_R}.execute_model", "patched", ("self", "scheduler_output"),
           "one engine step's target forward (the runner's _update_states runs first inside it)",
           "rows of requests that left the batch or resume are released in the step the runner "
           "learns it; the budget times the forward and measures its cost model at the first step"),
    Symbol(f"{_R}._prepare_inputs", "patched", ("self", "scheduler_output",
                                                "num_scheduled_tokens"),
           "lays out one step's inputs; returns (logits_indices, spec_decode_metadata, the most "
           "tokens a request samples); 0.32 builds the metadata whenever speculation is on, so "
           "_sample runs the rejection sampler even where no request has a draft, private",
           "a step that verifies no drafted token (D-Cut drafted nothing) takes vLLM's plain "
           "decoding path: no speculative metadata, the plain sampler (the same logits rows)"),
    Symbol(f"{_R}.propose_draft_token_ids", "patched", ("self", "scheduler_output",
                                                        "sampled_token_ids", "sampling_metadata"),
           "one proposal for the batch; sampled_token_ids: each request's emitted tokens this step "
           "([B, 1 + K] with -1 where rejected, or lists)",
           "rows follow the batch's requests before the drafter runs; the controller learns what "
           "the target emitted, prices each request's lookup draft (greedy batches), plans the "
           "depth before drafting and cuts the drafts into per-request lists; a plan that drafts "
           "nothing on the target's own cache returns before vLLM prepares anything"),
    Symbol(f"{_P}.propose", "patched", ("self", "num_speculative_tokens", "target_token_ids",
                                        "target_positions", "target_hidden_states",
                                        "next_token_ids"),
           "the drafter's first forward and its drafting loop; num_speculative_tokens=0 runs the "
           "first forward only",
           "on the target's own cache the next-token first pass takes num_rejected_tokens_gpu "
           "itself (see set_inputs_first_pass)"),
    Symbol(f"{_P}.set_inputs_first_pass", "patched", ("self", "target_token_ids",
                                                      "next_token_ids", "target_positions",
                                                      "target_hidden_states",
                                                      "token_indices_to_sample", "cad",
                                                      "num_rejected_tokens_gpu"),
           "lays out the first forward's tokens; returns (tokens, rows to sample, metadata)",
           "on the target's own cache the first forward runs each request's next token alone"),
    Symbol(f"{_P}._sample_draft_tokens", "patched", ("self", "hidden_states",
                                                     "sampling_metadata"),
           "every drafted token's logits and sampling (greedy or probabilistic), private",
           "the drafter's logits come from the trimmed head over each request's active ids; each "
           "token's confidence stays on the device until the controller's cut reads them once"),
    Symbol(f"{_P}.dummy_run", "patched", ("self", "num_tokens"),
           "the drafter's part of the runner's dummy run",
           "the cost model times the target alone through the runner's dummy run"),
    Symbol("vllm.v1.engine.input_processor:InputProcessor._validate_params", "patched",
           ("self", "params"), "checks a request's sampling parameters in the front end (a "
           "ValueError is the request's 400 error)",
           "a request's suffix-index tenant (vllm_xargs trimpass_tenant) is checked before the "
           "engine sees it: a tenant that is not a string, or another tenant than the one a "
           "server serves alone, is refused by name"),
    Symbol("vllm.v1.worker.worker_base:WorkerBase", "injected", (),
           "trimpass_stats and trimpass_budget methods on every worker, for collective_rpc",
           "LLM.collective_rpc sends a method name; a callable crosses to the engine core only "
           "with VLLM_ALLOW_INSECURE_SERIALIZATION=1"),
    Symbol("vllm.v1.worker.worker_base:WorkerBase.model_runner", "read", (), "the runner"),
    # ---- called ------------------------------------------------------------------------------
    Symbol(f"{_R}._dummy_run", "called", ("self", "num_tokens"),
           "one forward of num_tokens dummy tokens; force_attention=True builds attention metadata",
           "the start-up cost measurement C(batch, tokens) of the target alone"),
    Symbol(f"{_P}._sample_from_logits", "called", ("self", "logits", "sampling_metadata"),
           "vLLM's probabilistic draft sampling from logits: (ids, probs)",
           "probabilistic drafts sampled from the trimmed logits as vLLM samples them"),
    Symbol(f"{_LP}._gather_logits", "called", ("self", "logits"),
           "gathers a vocabulary-sharded head's logits across tensor-parallel ranks",
           "a sharded trimmed head's logits are joined as the plain head's are"),
    Symbol(f"{_CAD}.replace", "called", ("self",), "a copy of the metadata with fields replaced",
           "the next-token first pass's metadata"),
    Symbol(f"{_CAD}.batch_size", "called", ("self",), "requests in the metadata", ""),
    Symbol("vllm.config.model:ModelConfig.get_vocab_size", "called", ("self",),
           "the target's vocabulary size", "rows and static lists are target ids"),
    Symbol("vllm.model_executor.models.registry:_ModelRegistry.get_supported_archs", "called",
           ("self",), "architectures vLLM can build", "an EAGLE drafter class must exist"),
    Symbol("vllm.model_executor.models.registry:_ModelRegistry._try_load_model_cls", "called",
           ("self", "model_arch"), "the model class of an architecture, or None, private",
           "the EAGLE-3 route needs a target class with SupportsEagle3"),
    Symbol("vllm.model_executor.models.interfaces:supports_eagle3", "called", ("model",),
           "whether a model class gives EAGLE-3 drafters its layers' hidden states", ""),
    Symbol("vllm.logger:init_logger", "called", ("name",), "vLLM's logger", "workers log there"),
    Symbol("vllm.exceptions:VLLMValidationError", "called", (),
           "a request's validation failure: the OpenAI server answers it with a 400 naming it",
           "a plain ValueError raised while a request is added becomes a 500 with no message"),
    Symbol("vllm.entrypoints.llm:LLM.collective_rpc", "called", ("self", "method"),
           "runs a worker method on every worker", "stats(llm) and set_budget(llm, ...)"),
    # ---- read or written ---------------------------------------------------------------------
    *(Symbol(f"{_R}.{a}", "read", meaning=m) for a, m in (
        ("drafter", "the proposer"), ("input_batch", "the persistent batch"),
        ("device", "the runner's device"), ("max_num_tokens", "tokens one step may schedule"),
        ("compilation_config", "holds static_forward_context: layer name -> layer"),
        ("requests", "request id -> its CachedRequestState"))),
    Symbol("vllm.v1.worker.gpu_input_batch:CachedRequestState.sampling_params", "read", (),
           "the request's SamplingParams (None for pooling)"),
    Symbol("vllm.sampling_params:SamplingParams.extra_args", "read", (),
           "the OpenAI API's vllm_xargs: trimpass_tenant names the request's tenant"),
    Symbol("vllm.v1.engine.input_processor:InputProcessor.vllm_config", "read", (),
           "the front end's VllmConfig (additional_config: the budget's tenant setting)"),
    *(Symbol(f"{_IB}.{a}", "read", meaning=m) for a, m in (
        ("req_ids", "request ids by batch row"), ("num_reqs", "live rows"),
        ("num_tokens_no_spec", "each row's tokens, drafts excluded"),
        ("token_ids_cpu", "each row's tokens [rows, max_len] (numpy)"))),
    *(Symbol(f"{_P}.{a}", "read", meaning=m) for a, m in (
        ("model", "the drafter model"), ("vllm_config", "the engine's configuration"),
        ("draft_model_config", "the drafter's ModelConfig (its model: the checkpoint)"),
        ("num_speculative_tokens", "the longest draft"),
        ("use_local_argmax_reduction", "tokens without compute_logits: refused"),
        ("use_heterogeneous_vocab", "another vocabulary: refused"),
        ("parallel_drafting", "every draft in one pass: refused"),
        ("uses_mrope", "M-RoPE positions: no next-token first pass"),
        ("needs_extra_input_slots", "the draft-model route's first-pass layout"),
        ("input_ids", "the first forward's token buffer"),
        ("positions", "the first forward's position buffer"),
        ("_enable_probabilistic_draft_probs", "probabilistic drafts are on, private"),
        ("_draft_attn_layer_names", "the drafter's attention layer names, private"))),
    *(Symbol(f"vllm.model_executor.models.gemma3:Gemma3ForCausalLM.{a}", "read", p, m) for a, p, m
      in (("compute_logits", ("self", "hidden_states"),
           "the drafter's plain logits (every causal-LM drafter has it; Gemma3's recorded)"),
          ("lm_head", (), "the head (a ParallelLMHead; its weight [V, d])"),
          ("logits_processor", (), "softcap, scale, vocabulary, shard gathering"))),
    Symbol("vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM.draft_id_to_target_id",
           "read", (), "an EAGLE-3 head's own vocabulary: row i scores target id i + d2t[i]"),
    *(Symbol(f"{_LP}.{a}", "read", meaning=m) for a, m in (
        ("org_vocab_size", "the head's vocabulary before padding"),
        ("logits_as_input", "the hidden states are logits: plain head"),
        ("head_dtype", "the head's compute dtype"), ("soft_cap", "logit soft-capping"),
        ("scale", "logit scale"))),
    *(Symbol(f"{_VE}:VocabParallelEmbedding.{a}", "read", meaning=m) for a, m in (
        ("shard_indices", "this rank's vocabulary slice"), ("tp_size", "tensor-parallel ranks"),
        ("quant_method", "UnquantizedEmbeddingMethod: a plain weight"))),
    Symbol(f"{_VE}:VocabParallelEmbeddingShardIndices.org_vocab_start_index", "read", (),
           "the first id of this rank's slice"),
    Symbol(f"{_VE}:UnquantizedEmbeddingMethod", "read", (), "an unquantized head's method"),
    Symbol("vllm.v1.spec_decode.metadata:SpecDecodeMetadata.num_draft_tokens", "read", (),
           "each request's drafted tokens verified this step (a list)"),
    *(Symbol(f"{_SO}.{a}", "read", meaning=m) for a, m in (
        ("num_scheduled_tokens", "request id -> tokens this step"),
        ("total_num_scheduled_tokens", "tokens this step"),
        ("num_spec_tokens_to_schedule", "the tokens a proposal drafts for the next step"),
        ("scheduled_spec_decode_tokens", "request id -> drafted tokens verified this step"),
        ("scheduled_cached_reqs", "CachedRequestData of requests seen before"),
        ("scheduled_new_reqs", "NewRequestData of requests sent for the first time: bound"),
        ("finished_req_ids", "requests finished or aborted since the last step: released"))),
    Symbol("vllm.v1.core.sched.output:NewRequestData.req_id", "read", (), "the request's id"),
    Symbol(f"{_SO}", "called", (), "a dataclass: dataclasses.replace copies it",
           "a proposal drafts the depth the controller planned: vLLM's own proposal runs on a "
           "copy whose num_spec_tokens_to_schedule is that depth, so its chain runs its own "
           "course"),
    Symbol("vllm.v1.core.sched.output:CachedRequestData.resumed_req_ids", "read", (),
           "requests resuming after preemption: their rows are rebuilt"),
    Symbol("vllm.v1.sample.metadata:SamplingMetadata.all_greedy", "read", (),
           "every request greedy"),
    *(Symbol(f"{_CAD}.{a}", "read", meaning="the first forward's layout") for a in (
        "query_start_loc", "query_start_loc_cpu", "seq_lens", "num_actual_tokens",
        "max_query_len", "slot_mapping", "causal", "positions")),
    Symbol("vllm.model_executor.layers.attention.attention:Attention.kv_cache", "written", (),
           "the layer's cache tensor",
           "the target drafting for itself: its drafter layers take the target layers' caches"),
    Symbol("vllm.config.compilation:CompilationConfig.static_forward_context", "read", (),
           "layer name -> attention layer"),
    *(Symbol(f"vllm.config.vllm:VllmConfig.{a}", "read", meaning=m) for a, m in (
        ("additional_config", "a JSON dict carried to every worker: trimpass's settings"),
        ("scheduler_config", ""), ("model_config", ""), ("parallel_config", ""),
        ("speculative_config", ""))),
    Symbol("vllm.config.scheduler:SchedulerConfig.max_num_seqs", "read", (), "rows needed"),
    Symbol("vllm.config.scheduler:SchedulerConfig.async_scheduling", "read", (),
           "drafts of varying length need it off"),
    Symbol("vllm.config.model:ModelConfig.model", "read", (), "a checkpoint directory"),
    Symbol("vllm.config.model:ModelConfig.dtype", "read", (), "the cost model's cache key"),
    Symbol("vllm.config.parallel:ParallelConfig.rank", "read", (), "the stats file's rank"),
    Symbol("vllm.config.speculative:SpeculativeConfig.num_speculative_tokens", "read", (),
           "the longest draft, for set_budget's check"),
    *(Symbol(f"vllm.engine.arg_utils:EngineArgs.{a}", "read", meaning=m) for a, m in (
        ("model", "the target"), ("speculative_config", "the drafter's route"),
        ("additional_config", "trimpass's settings"))),
    Symbol("vllm.entrypoints.llm:LLM.llm_engine", "read", (), "the engine"),
    Symbol("vllm.v1.engine.llm_engine:LLMEngine.vllm_config", "read", (), ""),
)

PATCHES = tuple(s.place for s in SYMBOLS if s.use == "patched")
ADDITIONAL_KEY = "trimpass"  # additional_config's key for trimpass's settings
TENANT_KEY = "trimpass_tenant"  # a request's vllm_xargs key naming its suffix-index tenant
API_SERVER = "vllm.entrypoints.openai.api_server"  # the OpenAI server's module (python -m)


def find(place: str) -> Symbol:
    return next(s for s in SYMBOLS if s.place == place)


def resolve(place: str):
    """The installed object at ``place`` (imports vLLM)."""
    module, _, member = place.partition(":")
    obj = importlib.import_module(module)
    for name in member.split("."):
        obj = getattr(obj, name)
    return obj


def installed_version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return vllm.__version__


def log():
    """vLLM's logger (the standard library's where vLLM is not installed: stand-in tests)."""
    try:
        from vllm.logger import init_logger
    except ImportError:
        import logging
        return logging.getLogger("trimpass")
    return init_logger("vllm.trimpass")


def supported_archs() -> set:
    from vllm.model_executor.models import ModelRegistry
    return set(ModelRegistry.get_supported_archs())


def supports_eagle3(arch: str) -> bool:
    """Whether vLLM's class for target architecture ``arch`` feeds EAGLE-3 drafters."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3 as supports
    cls = ModelRegistry._try_load_model_cls(arch)
    return cls is not None and bool(supports(cls))


def in_api_server() -> bool:
    """Whether this process is vLLM's OpenAI server (its start-up errors print as one line)."""
    import sys
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and spec.name.startswith("vllm.entrypoints")


# ---- values taken out of vLLM's objects ---------------------------------------------------------
@dataclasses.dataclass
class Head:
    """A drafter's LM head as the trimmed logits need it; ``unusable`` says why it cannot be
    trimmed at all (then every call takes ``plain``)."""
    weight: torch.Tensor | None
    start: int
    tp_size: int
    softcap: float
    scale: float
    vocab: int
    head_dtype: object
    plain: object  # hidden states -> the plain head's logits
    gather: object  # a shard's logits -> every shard's (tensor parallelism), or None
    unusable: str | None


@dataclasses.dataclass
class Drafter:
    """What trimpass needs of a loaded drafter and its engine."""
    model: object
    target: object
    checkpoint: str | None
    additional: object  # additional_config's trimpass entry, or None
    max_num_seqs: int
    async_scheduling: bool
    gamma: int
    model_key: str
    target_vocab: int
    rank: int
    head: Head | None
    d2t: torch.Tensor | None
    refused: str | None  # a vLLM mode trimpass cannot follow (names its flag)
    first_pass_ok: bool


@dataclasses.dataclass
class Batch:
    """The runner's batch: request ids by row, each row's tokens (drafts excluded), each
    request's tenant (its ``vllm_xargs`` :data:`TENANT_KEY`, as given; "" where none)."""
    req_ids: list
    lengths: list
    array: object  # [rows, max_len] numpy array of tokens
    tenants: list = dataclasses.field(default_factory=list)

    def tokens(self, i: int, a: int, b: int):
        return self.array[i, a:b].copy()


@dataclasses.dataclass
class Step:
    """One engine step as the scheduler sent it."""
    scheduled: dict  # request id -> tokens this step
    resumed: set
    drafts: dict  # request id -> drafted tokens verified this step
    tokens: int
    new: tuple = ()  # requests sent for the first time
    finished: tuple = ()  # requests finished or aborted since the last step


def _head(model) -> Head | None:
    if not all(hasattr(model, a) for a in ("compute_logits", "lm_head", "logits_processor")):
        return None
    proc, head = model.logits_processor, model.lm_head
    W = getattr(head, "weight", None)
    unusable = None
    if proc.logits_as_input:
        unusable = "the drafter's hidden states are its logits"
    elif W is None or type(head.quant_method).__name__ != "UnquantizedEmbeddingMethod":
        unusable = "the drafter's head is quantized"
    return Head(W, head.shard_indices.org_vocab_start_index, head.tp_size, proc.soft_cap or 0.0,
                proc.scale, proc.org_vocab_size, proc.head_dtype, model.compute_logits,
                proc._gather_logits if head.tp_size > 1 else None, unusable)


def drafter(proposer, target_model) -> Drafter:
    cfg, model = proposer.vllm_config, proposer.model
    extra = cfg.additional_config
    extra = extra.get(ADDITIONAL_KEY) if isinstance(extra, dict) else None
    refused = next((f for f in ("use_local_argmax_reduction", "use_heterogeneous_vocab",
                                "parallel_drafting") if getattr(proposer, f, False)), None)
    d2t = getattr(model, "draft_id_to_target_id", None)
    return Drafter(
        model=model, target=target_model,
        checkpoint=getattr(proposer.draft_model_config, "model", None), additional=extra,
        max_num_seqs=int(cfg.scheduler_config.max_num_seqs),
        async_scheduling=bool(getattr(cfg.scheduler_config, "async_scheduling", False)),
        gamma=int(proposer.num_speculative_tokens),
        model_key=f"{cfg.model_config.model}:{cfg.model_config.dtype}",
        target_vocab=int(cfg.model_config.get_vocab_size()),
        rank=int(getattr(cfg.parallel_config, "rank", 0)), head=_head(model),
        d2t=None if d2t is None else d2t.data, refused=refused,
        first_pass_ok=not proposer.uses_mrope and bool(proposer.needs_extra_input_slots)
        and not proposer.parallel_drafting)


def batch(runner) -> Batch:
    ib = runner.input_batch
    n = ib.num_reqs
    ids, states = list(ib.req_ids[:n]), getattr(runner, "requests", {})  # stand-ins have none
    return Batch(ids, [int(ib.num_tokens_no_spec[i]) for i in range(n)], ib.token_ids_cpu,
                 [tenant_of(states.get(r)) for r in ids])


def extra_args(params) -> dict:
    """A request's ``extra_args`` (the OpenAI API's ``vllm_xargs``), {} where none."""
    return getattr(params, "extra_args", None) or {}


def tenant_of(state) -> object:
    return extra_args(getattr(state, "sampling_params", None)).get(TENANT_KEY, "")


def step(scheduler_output) -> Step:
    so = scheduler_output
    return Step(dict(so.num_scheduled_tokens), set(so.scheduled_cached_reqs.resumed_req_ids),
                {r: len(v) for r, v in so.scheduled_spec_decode_tokens.items()},
                int(so.total_num_scheduled_tokens),
                tuple(r.req_id for r in so.scheduled_new_reqs), tuple(so.finished_req_ids))


def emitted_ids(sampled) -> list[list[int]]:
    """The tokens each request emitted this step, from the runner's ``sampled_token_ids`` (a [B,
    1 + K] tensor with -1 where rejected, or lists)."""
    if isinstance(sampled, torch.Tensor):
        if sampled.dim() != 2:
            return []
        return [[t for t in row if t >= 0] for row in sampled.cpu().tolist()]
    return [list(x) for x in sampled or ()]


def verified_drafts_metric() -> str:
    return "vllm:spec_decode_num_draft_tokens"


def llm_gamma(llm) -> int:
    return int(llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens)


def rpc(llm, method: str, *args) -> list:
    return llm.collective_rpc(method, args=args)


# ---- the wrappers -------------------------------------------------------------------------------
_installed: set = set()
_signatures: dict = {}


def _bound(original, self, args, kwargs) -> dict:
    sig = _signatures.get(original)
    if sig is None:
        import inspect
        sig = _signatures[original] = inspect.signature(original)
    got = sig.bind(self, *args, **kwargs).arguments
    got.pop(next(iter(sig.parameters)))
    extra = got.pop("kwargs", None) if "kwargs" in sig.parameters else None
    return {**got, **(extra or {})}


def _state_of_runner(hooks, runner):
    d = getattr(runner, "drafter", None)
    return None if d is None else hooks.state(d)


def _engine_config(hooks, original):
    def wrapper(self, *args, **kwargs):
        try:
            hooks.startup(self.speculative_config, self.model, self.additional_config)
        except hooks.error as e:
            if in_api_server():
                raise SystemExit(f"trimpass: {e}") from None
            raise
        return original(self, *args, **kwargs)
    return wrapper


def _load_model(hooks, original):
    def wrapper(self, target_model, *args, **kwargs):
        out = original(self, target_model, *args, **kwargs)
        hooks.loaded(self, drafter(self, target_model))
        return out
    return wrapper


def _init_kv(hooks, original):
    def wrapper(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        st = _state_of_runner(hooks, self)
        if st is None or not st.self_drafting:
            return out
        ctx = self.compilation_config.static_forward_context
        names = sorted(self.drafter._draft_attn_layer_names)
        pairs = {n: (ctx[n].kv_cache, getattr(ctx.get(n.removeprefix("draft_model.")),
                                              "kv_cache", None)
                     if n.startswith("draft_model.") else None) for n in names}
        for n, cache in st.share_cache(pairs).items():
            ctx[n].kv_cache = cache
        log().info("trimpass: the drafter is the target; its %d attention layers use the "
                   "target's KV cache, its first forward each request's next token", len(names))
        return out
    return wrapper


def _execute(hooks, original):
    def wrapper(self, scheduler_output, *args, **kwargs):
        st = _state_of_runner(hooks, self)
        if st is None:
            return original(self, scheduler_output, *args, **kwargs)
        return st.step(step(scheduler_output),
                       lambda: original(self, scheduler_output, *args, **kwargs),
                       verify=lambda n: self._dummy_run(n, force_attention=True),
                       device=self.device, max_tokens=int(self.max_num_tokens))
    return wrapper


def _prepare_inputs(hooks, original):
    def wrapper(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        st = _state_of_runner(hooks, self)
        meta = out[1]
        if st is None or meta is None or any(meta.num_draft_tokens):
            return out
        st.plain_step()  # with no drafts the metadata's logits rows are the plain path's
        return out[0], None, 1
    return wrapper


def _propose_draft(hooks, original):
    def wrapper(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        t0, st = time.perf_counter(), _state_of_runner(hooks, self)
        try:
            if st is None:
                return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
            so = scheduler_output
            sm = _bound(original, self, (so, sampled_token_ids, *args), kwargs).get(
                "sampling_metadata")

            def run(depth: int):  # vLLM's own proposal, its chain as deep as planned
                plan = dataclasses.replace(so, num_spec_tokens_to_schedule=depth)
                return original(self, plan, sampled_token_ids, *args, **kwargs)

            return st.draft(batch(self), lambda: emitted_ids(sampled_token_ids), run,
                            gamma=int(so.num_spec_tokens_to_schedule),
                            tokens=int(so.total_num_scheduled_tokens), device=self.device,
                            greedy=bool(getattr(sm, "all_greedy", False)) or not getattr(
                                self.drafter, "_enable_probabilistic_draft_probs", True))
        finally:
            hooks.proposed(time.perf_counter() - t0)
    return wrapper


def _propose(hooks, original):
    def wrapper(self, *args, **kwargs):
        st = hooks.state(self)
        if st is None or not st.cache_shared:
            return original(self, *args, **kwargs)
        kw = _bound(original, self, args, kwargs)
        st.rejected = kw.get("num_rejected_tokens_gpu")  # applied once, by the first pass
        kw["num_rejected_tokens_gpu"] = None
        try:
            return original(self, **kw)
        finally:
            st.rejected = None
    return wrapper


def _first_pass(hooks, original):
    def wrapper(self, *args, **kwargs):
        st = hooks.state(self)
        if st is None or not st.cache_shared:
            return original(self, *args, **kwargs)
        kw = _bound(original, self, args, kwargs)
        kw["num_rejected_tokens_gpu"] = st.rejected
        _, rows, cad = original(self, **kw)
        B = cad.batch_size()
        if rows.numel() != B or isinstance(cad.causal, torch.Tensor):
            raise RuntimeError("trimpass: the next-token first pass takes one sampled row "
                               "per request and a causal mask")
        rows = rows.long()
        ids, pos = self.input_ids[rows].clone(), self.positions[rows].clone()
        self.input_ids[:B], self.positions[:B] = ids, pos
        start = torch.arange(B + 1, dtype=cad.query_start_loc.dtype)
        decode = cad.replace(
            query_start_loc=start.to(cad.query_start_loc.device), query_start_loc_cpu=start,
            seq_lens=(pos + 1).to(cad.seq_lens.dtype), num_actual_tokens=B, max_query_len=1,
            slot_mapping=cad.slot_mapping[rows],
            positions=None if cad.positions is None else pos)
        st.first_pass_ran(B)
        return B, torch.arange(B, dtype=torch.int32, device=rows.device), decode
    return wrapper


def _sample(hooks, original):
    def wrapper(self, hidden_states, sampling_metadata, *args, **kwargs):
        st = hooks.state(self)
        if st is None:
            return original(self, hidden_states, sampling_metadata, *args, **kwargs)
        logits, top = st.logits(hidden_states)
        if not self._enable_probabilistic_draft_probs or sampling_metadata.all_greedy:
            ids, probs = logits.argmax(dim=-1), None
        else:
            ids, probs = self._sample_from_logits(logits, sampling_metadata)
        st.drafted(ids, probs, logits, top)
        return ids, probs
    return wrapper


def _validate(hooks, original):
    def wrapper(self, params, *args, **kwargs):
        extra = self.vllm_config.additional_config
        extra = extra.get(ADDITIONAL_KEY) if isinstance(extra, dict) else None
        try:
            hooks.request(extra, extra_args(params))
        except ValueError as e:
            from vllm.exceptions import VLLMValidationError
            raise VLLMValidationError(str(e), parameter="vllm_xargs") from None
        return original(self, params, *args, **kwargs)
    return wrapper


def _dummy_run(hooks, original):
    def wrapper(self, *args, **kwargs):
        st = hooks.state(self)
        if st is not None and st.measuring:
            return None
        return original(self, *args, **kwargs)
    return wrapper


WRAPPERS = (_engine_config, _load_model, _init_kv, _execute, _prepare_inputs, _propose_draft,
            _propose, _first_pass, _sample, _dummy_run, _validate)  # one per patched symbol


def install(hooks, places=PATCHES) -> None:
    """Wrap each of ``places`` (in :data:`PATCHES`' order) once per process, and add the two
    worker methods when every patch is installed. A wrapper delegates to vLLM's own method
    unless ``hooks.state`` has a trimpass state for the object."""
    wrappers = dict(zip(PATCHES, WRAPPERS, strict=True))
    for place in PATCHES:
        if place not in places or place in _installed:
            continue
        owner_place, _, name = place.rpartition(".")
        owner = resolve(owner_place)
        original = getattr(owner, name)
        setattr(owner, name, functools.wraps(original)(wrappers[place](hooks, original)))
        _installed.add(place)
    if set(PATCHES) <= _installed and "worker" not in _installed:
        worker = resolve("vllm.v1.worker.worker_base:WorkerBase")
        worker.trimpass_stats = lambda self: hooks.worker_stats(
            _state_of_runner(hooks, getattr(self, "model_runner", None)))
        worker.trimpass_budget = lambda self, settings: hooks.set_budget(
            _state_of_runner(hooks, getattr(self, "model_runner", None)), settings)
        _installed.add("worker")
