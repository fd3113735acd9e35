"""The speculation core's settings: frozen dataclasses, each default written once and every field
checked at construction, with an error naming the field and what it takes. :class:`LookupConfig`
(lookup drafts from a request's own text), :class:`GenerateConfig` (:func:`trimpass.generate`'s
fused loop: draft length, confidence stop, lookup, sampling), :class:`SelfDraftConfig` (Hugging
Face's assisted route with the model as its own drafter) and :class:`BudgetConfig` (the vLLM
adapter's verification budget). ``from_dict`` refuses an unknown key by name; checks that need the
engine (a draft length against ``num_speculative_tokens``) run where the config meets the engine,
before it starts (:meth:`BudgetConfig.for_engine`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

# policy name -> whether it prices drafts by calibrated confidence (what prices a lookup draft)
POLICIES = {"dcut": True, "all-or-nothing": True, "fixed": False, "none": False, "off": False}
PROBE = 1 / 16  # the share of skipped seconds a budget's probes may spend
WHOLE = "a positive integer"
LOOKUP_TOKENS = 15  # the fused loop's lookup drafts: verified in one batched pass
# the rows past its capacity the fused loop's cache lets one round's pass write and roll back:
# a tree verified in one pass holds at most this many rows, its root (the pending token) included
TREE_ROWS = 64


def positive_int(name: str, value, what: str, kind: str = "an int >= 1") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {what}, {kind}, got {value!r}")


def probability(name: str, value, what: str, note: str = "", lo_open=False,
                hi_open=True) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) \
        and (value > 0 if lo_open else value >= 0) and (value < 1 if hi_open else value <= 1)
    if not ok:
        span = f"{'(' if lo_open else '['}0, 1{')' if hi_open else ']'}"
        raise ValueError(f"{name}: {what} in {span}{note}, got {value!r}")


def from_dict(cls, values: dict, where: str):
    """``cls(**values)`` after refusing, by name, a key that is not one of its fields."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: a dict of {', '.join(f.name for f in fields(cls))}, got "
                         f"{type(values).__name__}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown setting {unknown[0]!r}; use {', '.join(names)}")
    return cls(**values)


@dataclass(frozen=True)
class LookupConfig:
    """Lookup drafts: after the text's longest recurring suffix of ``min_match`` to ``ngram``
    tokens, up to ``tokens`` tokens that followed it (``None``: the engine's draft length). Match
    lengths above ``match_cap`` are priced together."""
    tokens: int | None = LOOKUP_TOKENS
    ngram: int = 4
    min_match: int = 1
    match_cap: int = 4

    def __post_init__(self):
        if self.tokens is not None:
            positive_int("lookup tokens", self.tokens, "the longest lookup draft", WHOLE)
        positive_int("lookup ngram", self.ngram, "the longest suffix a lookup matches", WHOLE)
        positive_int("lookup min_match", self.min_match, "the shortest suffix that proposes",
                     WHOLE)
        positive_int("lookup match_cap", self.match_cap, "match lengths priced apart", WHOLE)
        if self.min_match > self.ngram:
            raise ValueError(f"lookup min_match: at most ngram ({self.ngram}), got "
                             f"{self.min_match}")

    @classmethod
    def of(cls, value, default_tokens: int | None = LOOKUP_TOKENS) -> LookupConfig | None:
        """``True`` (the defaults, ``default_tokens`` tokens), ``False``/``None`` (off), an int
        (tokens), a dict of fields or a LookupConfig."""
        if value is None or value is False:
            return None
        if value is True:
            return cls(tokens=default_tokens)
        if isinstance(value, cls):
            return value
        if isinstance(value, int):
            return cls(tokens=value)
        if isinstance(value, dict):
            return from_dict(cls, {"tokens": default_tokens, **value}, "lookup")
        raise ValueError(f"lookup: True, False, a number of tokens, a dict of "
                         f"{', '.join(f.name for f in fields(cls))} or a LookupConfig, got "
                         f"{type(value).__name__}")


def check_tenant(tenant) -> None:
    """A tenant key: a string (the default tenant, a library caller's, is ``""``)."""
    if not isinstance(tenant, str):
        raise ValueError(f"tenant: a string naming whose earlier outputs may draft for this "
                         f"request (\"\": the default tenant), got {type(tenant).__name__}")


def switched(cls, value, name: str):
    """A setting that is on or off: ``True`` (``cls``'s defaults), ``False``/``None`` (off), a
    dict of its fields or a ``cls``; anything else refused by ``name``."""
    if value is None or value is False:
        return None
    if value is True:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return from_dict(cls, value, name)
    raise ValueError(f"{name}: True, False, a dict of {', '.join(f.name for f in fields(cls))} "
                     f"or a {cls.__name__}, got {type(value).__name__}")


@dataclass(frozen=True)
class SuffixConfig:
    """The suffix index's drafts: after the longest match of up to ``depth`` tokens (at least
    ``min_match``) in the request's own text or its tenant's earlier outputs, up to ``tokens``
    tokens (and ``factor`` times the match) that most of the matches continue with, while their
    estimated probability stays at or above ``min_prob``. Earlier outputs are kept within
    ``max_bytes`` (the least recently used leave first), per tenant unless ``share``."""
    tokens: int = LOOKUP_TOKENS
    depth: int = 64
    min_match: int = 2
    factor: float | None = None  # ArcticInference's 1.0: x0.86 of 8.0 (bench/results/suffix.md)
    min_prob: float = 0.1
    max_bytes: int = 64 << 20
    share: bool = False

    def __post_init__(self):
        positive_int("suffix tokens", self.tokens, "the longest suffix draft", WHOLE)
        positive_int("suffix depth", self.depth, "the longest match measured, in tokens", WHOLE)
        positive_int("suffix min_match", self.min_match, "the shortest match that drafts", WHOLE)
        if self.min_match > self.depth:
            raise ValueError(f"suffix min_match: at most depth ({self.depth}), got "
                             f"{self.min_match}")
        f = self.factor
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or
                              not f > 0):
            raise ValueError(f"suffix factor: draft tokens per matched token, a number > 0 (None: "
                             f"no limit), got {f!r}")
        probability("suffix min_prob", self.min_prob, "the lowest estimated probability a draft "
                    "continues at,")
        positive_int("suffix max_bytes", self.max_bytes, "the byte cap of earlier outputs kept "
                     "across requests (every tenant's together)")
        if not isinstance(self.share, bool):
            raise ValueError(f"suffix share: True (every tenant drafts from every tenant's "
                             f"outputs) or False, got {self.share!r}")

    @classmethod
    def of(cls, value) -> SuffixConfig | None:
        """``True`` (the defaults), ``False``/``None`` (off), a dict of fields or a
        SuffixConfig."""
        return switched(cls, value, "suffix")


@dataclass(frozen=True)
class TreeConfig:
    """Free drafts verified as a tree: up to ``size`` drafted tokens in one pass (the suffix
    index's continuations best-first by estimated probability, the lookup draft beside them), none
    deeper than ``depth``; each round verifies the prefix of that tree worth the most tokens per
    measured second."""
    size: int = LOOKUP_TOKENS
    depth: int = LOOKUP_TOKENS

    def __post_init__(self):
        most = TREE_ROWS - 1
        for name, v, what in (("size", self.size, "drafted tokens verified in one pass"),
                              ("depth", self.depth, "the deepest drafted token")):
            positive_int(f"tree {name}", v, what, WHOLE)
            if v > most:
                raise ValueError(f"tree {name}: the loop's cache rolls back at most {TREE_ROWS} "
                                 f"rows a pass (the pending token and {most} drafted), got {v}; "
                                 f"ask for at most {most}")
        if self.depth > self.size:
            raise ValueError(f"tree depth: at most size ({self.size}), got {self.depth}")

    @classmethod
    def of(cls, value) -> TreeConfig | None:
        """``True`` (the defaults), ``False``/``None`` (chains), a dict of fields or a
        TreeConfig."""
        return switched(cls, value, "tree")


@dataclass(frozen=True)
class Sampling:
    """``model.generate``'s sampling settings (``do_sample=False``: greedy)."""
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample: True or False, got {self.do_sample!r}")
        t = self.temperature
        if self.do_sample and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ValueError(f"temperature: must be > 0 when sampling (do_sample=False decodes "
                             f"greedily), got {t!r}")
        if self.top_k is not None:
            positive_int("top_k", self.top_k, "ids kept for sampling (None: all)")
        if self.top_p is not None:
            probability("top_p", self.top_p, "a probability", " (None: no nucleus)",
                        lo_open=True, hi_open=False)


@dataclass(frozen=True)
class GenerateConfig:
    """:func:`trimpass.generate`'s loop: the trimmed head drafts up to ``gamma`` tokens, stopping
    below ``confidence``; ``lookup`` adds drafts from the text repeating itself, ``suffix`` from
    the suffix index (the text and its tenant's earlier outputs; None: off), verified as one
    ``tree`` (None: as the better chain)."""
    gamma: int = 8  # x1.67 the plain target against x1.49 at a fixed 4 (bench/results/peers.md)
    confidence: float = 0.4
    lookup: LookupConfig | None = field(default_factory=LookupConfig)
    sampling: Sampling = field(default_factory=Sampling)
    suffix: SuffixConfig | None = field(default_factory=SuffixConfig)
    tree: TreeConfig | None = field(default_factory=TreeConfig)

    def __post_init__(self):
        check_schedule(self.gamma, self.confidence)
        if self.tree is not None and not isinstance(self.tree, TreeConfig):
            raise ValueError(f"tree: a TreeConfig or None, got {type(self.tree).__name__}")
        if self.lookup is not None and not isinstance(self.lookup, LookupConfig):
            raise ValueError(f"lookup: a LookupConfig or None, got {type(self.lookup).__name__}")
        if self.lookup is not None and self.lookup.tokens is None:
            raise ValueError("lookup tokens: the fused loop needs a number of tokens, got None")
        if not isinstance(self.sampling, Sampling):
            raise ValueError(f"sampling: a Sampling, got {type(self.sampling).__name__}")
        if self.suffix is not None and not isinstance(self.suffix, SuffixConfig):
            raise ValueError(f"suffix: a SuffixConfig or None, got {type(self.suffix).__name__}")

    @property
    def lookup_tokens(self) -> int:
        return 0 if self.lookup is None else self.lookup.tokens

    @property
    def free_tokens(self) -> int:
        """The most free drafted tokens (lookup, suffix index, their tree) a round verifies."""
        chains = max(self.lookup_tokens, 0 if self.suffix is None else self.suffix.tokens)
        return max(chains, self.tree.size) if self.tree is not None and chains else chains

    @classmethod
    def of(cls, gamma=None, confidence=None, lookup=True, suffix=True, tree=True,
           **sampling) -> GenerateConfig:
        """From :func:`trimpass.generate`'s arguments (None: the default)."""
        base, most = cls.__dataclass_fields__, LookupConfig.tokens
        takes = isinstance(lookup, (bool, dict, LookupConfig)) or isinstance(lookup, int) \
            and 1 <= lookup <= most
        if not takes:
            raise ValueError(f"lookup: True (drafts of up to {most} tokens from the text "
                             f"repeating itself), False (off), or the most tokens a draft "
                             f"proposes, an int in [1, {most}]; got {lookup!r}")
        return cls(gamma=base["gamma"].default if gamma is None else gamma,
                   confidence=base["confidence"].default if confidence is None else confidence,
                   lookup=LookupConfig.of(lookup), sampling=Sampling(**sampling),
                   suffix=SuffixConfig.of(suffix), tree=TreeConfig.of(tree))


def check_schedule(gamma, confidence) -> None:
    """A draft length and confidence stop of a self-drafter (Hugging Face's loop or the fused
    one)."""
    positive_int("gamma", gamma, "tokens drafted per verification")
    probability("confidence", confidence, "the drafter's probability below which a draft stops,",
                " (0: always gamma tokens)")


@dataclass(frozen=True)
class SelfDraftConfig:
    """Hugging Face's assisted generation with the model as its own drafter: ``gamma`` tokens a
    draft at most (HF's loop stops earlier on ``confidence``)."""
    gamma: int = 16
    confidence: float = 0.4

    def __post_init__(self):
        check_schedule(self.gamma, self.confidence)


@dataclass(frozen=True)
class BudgetConfig:
    """The vLLM adapter's verification budget: ``policy`` (:data:`POLICIES`), the ``fixed``
    policy's ``gamma``, D-Cut's ``buckets``, the start-up measurement's ``measure_s``, a measured
    cost ``table`` (a ``CostTable.to_dict()``, read by the budget), the ``probe`` share,
    ``lookup`` drafts (``"auto"``, the default: on where the policy prices drafts; their tokens
    default to the engine's draft length), the ``suffix`` index's (``"auto"`` likewise), and whose
    earlier outputs a request drafts from: ``tenant`` None (each request's own, its
    ``vllm_xargs`` ``trimpass_tenant``; none given: the default tenant ``""``) or a string (the
    server serves that one tenant; a request naming another is refused unless ``suffix`` shares
    across tenants)."""
    policy: str = "dcut"
    gamma: int | None = None
    buckets: tuple | None = None
    measure_s: float = 10.0
    table: dict | None = None
    probe: float = PROBE
    lookup: LookupConfig | bool | dict | str | None = "auto"
    suffix: SuffixConfig | bool | dict | str | None = "auto"
    tenant: str | None = None

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"budget policy: {self.policy!r} is not one of "
                             f"{', '.join(POLICIES)}")
        if self.policy == "fixed" and self.gamma is not None:  # present: checked with the engine
            positive_int("budget gamma", self.gamma, "the fixed policy needs an integer "
                         "1..num_speculative_tokens", WHOLE)
        elif self.gamma is not None:
            raise ValueError(f"budget gamma: only the fixed policy takes a draft length; "
                             f"{self.policy!r} drafts up to num_speculative_tokens")
        if self.buckets is not None and self.policy != "dcut":
            raise ValueError("budget buckets: only the dcut policy takes buckets")
        m = self.measure_s
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m <= 30:
            raise ValueError(f"budget measure_s: the start-up measurement's seconds, in (0, 30], "
                             f"got {m!r}")
        probability("budget probe", self.probe, "the share of skipped seconds probes may spend,",
                    lo_open=True, hi_open=False)
        object.__setattr__(self, "lookup", self._lookup())
        object.__setattr__(self, "suffix", self._suffix())
        if self.tenant is not None:
            check_tenant(self.tenant)

    def _lookup(self) -> LookupConfig | None:
        value = self.lookup
        if value not in (None, False, "auto") and not isinstance(value, (bool, dict,
                                                                         LookupConfig)):
            raise ValueError(f"budget lookup: true, false or a dict of ngram, tokens, got "
                             f"{type(value).__name__}")
        return self._source("lookup", lambda v: LookupConfig.of(v, default_tokens=None))

    def _suffix(self) -> SuffixConfig | None:
        return self._source("suffix", SuffixConfig.of)

    def _source(self, name: str, parse):
        """A free-draft source's setting parsed (``"auto"``: on where the policy prices drafts),
        refused by name where the policy does not price drafts."""
        value = getattr(self, name)
        try:
            out = parse(POLICIES[self.policy] if value == "auto" else value)
        except ValueError as e:
            raise ValueError(f"budget {e}") from None
        if out is not None and not POLICIES[self.policy]:
            raise ValueError(f"budget {name}: the {self.policy!r} policy does not price drafts; "
                             f"{name} drafts need dcut or all-or-nothing (or set {name} to false)")
        return out

    @classmethod
    def of(cls, settings: dict) -> BudgetConfig:
        """From a budget dict (``engine_args(..., budget=...)``), refusing an unknown key."""
        return from_dict(cls, settings, "budget")

    def for_engine(self, gamma_max: int) -> dict:
        """The settings as the budget reads them, checked against the engine's draft length
        ``gamma_max`` (``num_speculative_tokens``): lookup tokens default to it and stay below."""
        if isinstance(gamma_max, bool) or not isinstance(gamma_max, int) or gamma_max < 1:
            raise ValueError(f"num_speculative_tokens: D-Cut needs a draft length >= 1 "
                             f"(gamma_max), got {gamma_max!r}")
        if self.policy == "fixed" and (self.gamma is None or self.gamma > gamma_max):
            raise ValueError(f"budget gamma: the fixed policy needs an integer 1..{gamma_max} "
                             f"(num_speculative_tokens), got {self.gamma!r}")
        look = self.lookup
        if look is not None:
            look = replace(look, tokens=gamma_max) if look.tokens is None else look
            if look.tokens > gamma_max:
                raise ValueError(f"budget lookup tokens: a request's longest lookup draft, an "
                                 f"integer 1..{gamma_max} (num_speculative_tokens), got "
                                 f"{look.tokens!r}")
        given = {k: v for k, v in (("gamma", self.gamma), ("buckets", self.buckets),
                                   ("table", self.table)) if v is not None}
        suffix = None if self.suffix is None else asdict(self.suffix)
        return dict(policy=self.policy, **given, measure_s=self.measure_s, probe=self.probe,
                    lookup=None if look is None else {"ngram": look.ngram, "tokens": look.tokens},
                    suffix=suffix, tenant=self.tenant)
