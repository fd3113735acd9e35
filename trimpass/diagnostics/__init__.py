"""Diagnostics, outside the runtime: attached to a loop by its hooks, never imported by it. The
trace and replay of a fused-loop call (:mod:`trimpass.diagnostics.replay`) and the divergence
oracle that tells a near-tie from a bug (:mod:`trimpass.diagnostics.divergence`)."""
