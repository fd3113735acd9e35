"""The speculation core, engine-neutral: what both engines' loops stand on. Its settings as frozen,
checked dataclasses (:mod:`~trimpass.spec.config`); one ragged record of a step's drafts
(:mod:`~trimpass.spec.drafts`); the draft sources, one module each (:mod:`~trimpass.spec.proposers`:
lookup drafts from each request's own text); and verification, the one place the acceptance rule
is computed (:mod:`~trimpass.spec.verify`). It imports nothing of the engines (``hf/``,
``serving/``) or of a benchmark."""
