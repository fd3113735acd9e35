"""Training objectives for drafters: acceptance-length losses and GRPO pieces (see ``losses``)."""
from trimpass.train.losses import (
    eal_loss,
    expected_length,
    greedy_acceptance,
    group_advantages,
    grpo_objective,
    kl_loss,
    sampling_acceptance,
    simulate_greedy,
    simulate_sampling,
    wtv_loss,
)

__all__ = ["greedy_acceptance", "sampling_acceptance", "expected_length", "kl_loss", "eal_loss",
           "wtv_loss", "group_advantages", "grpo_objective", "simulate_greedy",
           "simulate_sampling"]
