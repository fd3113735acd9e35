"""Training drafters for acceptance length: the losses and GRPO pieces (``losses``), the
target-output cache (``cache``), training text (``data``) and the training loop (``trainer``)."""
from trimpass.train.cache import TargetCache, build_cache, load_cache
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
from trimpass.train.trainer import TrainResult, evaluate, train

__all__ = ["train", "evaluate", "TrainResult", "TargetCache", "build_cache", "load_cache",
           "greedy_acceptance", "sampling_acceptance", "expected_length", "kl_loss", "eal_loss",
           "wtv_loss", "group_advantages", "grpo_objective", "simulate_greedy",
           "simulate_sampling"]
