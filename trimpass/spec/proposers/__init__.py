"""Draft sources, one module each, engine-neutral: each proposes from an engine's view of the batch
(request ids, their token arrays and lengths) and returns one :class:`~trimpass.spec.drafts.Drafts`
record; its per-request state is a cache it can always rebuild from that view
(:mod:`.requests`). ``lookup`` (the latest occurrence of the text's last 1-4 tokens) and ``suffix``
(the suffix index: longest matches with counts, in the text and its tenant's earlier outputs).
Both engines use them: :func:`trimpass.generate`'s loop as a batch of one, the vLLM adapter per
step."""
