"""trimpass: trim a speculative-decoding drafter's LM head to an active vocabulary, by compiler pass."""
from trimpass import ops  # noqa: F401  (registers the torch.library ops)

__all__ = ["ops"]
