"""Helpers for the tests and the benches: small hand-written drafters with random weights and real
structure, gpt-fast-style, EAGLE-style, Medusa (:mod:`~trimpass.testing.models`), and the check
that a trimmed head ran on every drafter call (:mod:`~trimpass.testing.checks`)."""
