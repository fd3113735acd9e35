"""The admission-policy interface of the dynamic vocabulary: a policy adds ids to a request's row
beside the ids the request receives (its context), and may keep drafter-wide memory for it. The
state (:class:`~trimpass.dynamic.state.ActiveState`) builds every registered policy its settings
turn on and calls it on each admission and each request start, with static shapes and no host read
(the step must stay CUDA-graph capturable). A new policy is one file in ``trimpass/dynamic/`` with
a subclass of :class:`AdmissionPolicy`, its entry in ``state.ADMISSION``, and its setting in
:class:`trimpass.TrimConfig` (field, default, check)."""
from __future__ import annotations

import torch


class AdmissionPolicy:
    """Base class: a policy that admits nothing more."""
    setting = ""  # the DynamicSettings field that configures it; 0 turns it off

    @classmethod
    def wanted(cls, settings) -> bool:
        return bool(getattr(settings, cls.setting))

    def __init__(self, settings, rows: int, V: int, device: torch.device):
        self.settings = settings

    def extra(self, ids: torch.Tensor, rows) -> torch.Tensor:
        """Ids ``[B, n]`` to admit into the rows ``rows`` beside the received ``ids[B, S]``."""
        return ids[:, :0]

    def restart(self, rows, fresh: torch.Tensor) -> None:
        """Rows where ``fresh[B, 1]`` holds start a new request: forget what is per request."""

    def bytes_per_row(self) -> int:
        """Bytes it keeps per request row (its drafter-wide tensors aside)."""
        return 0

    def stats(self) -> dict:
        return {}
