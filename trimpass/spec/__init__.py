"""The speculation core, engine-neutral: what both engines' loops share (so far the lookup
proposer over each request's own text, :mod:`trimpass.spec.lookup`)."""
