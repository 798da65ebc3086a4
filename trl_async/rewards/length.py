"""Length rewards, computed from the completion mask alone (no ids, no tokenizer).

The length of a completion is ``completion_mask.sum(1)``: the number of completion tokens, EOS included, which is
``len(completion_ids[i])`` in TRL's reward signature. So :class:`SoftOverlongPunishment` returns exactly what TRL's
``trl.rewards.get_soft_overlong_punishment`` returns (tested).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import TensorReward, column_tensor


class SoftOverlongPunishment(TensorReward):
    r"""DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), with ``L_max = max_completion_length``:

    ``0`` when ``len <= L_max - L_cache``; ``((L_max - L_cache) - len) / L_cache`` (from 0 down to -1) in between;
    ``-1`` when ``len > L_max``. Multiply by ``penalty`` (default 1).
    """

    default_name = "soft_overlong_punishment"

    def __init__(self, max_completion_length: int, soft_punish_cache: int, penalty: float = 1.0, name=None):
        if not 0 < soft_punish_cache <= max_completion_length:
            raise ValueError(
                f"Need 0 < soft_punish_cache <= max_completion_length, got {soft_punish_cache} and "
                f"{max_completion_length}. DAPO uses a cache of about a fifth of the maximum length."
            )
        super().__init__(None, None, name)
        self.max_completion_length = max_completion_length
        self.soft_punish_cache = soft_punish_cache
        self.penalty = penalty

    def score(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, **columns: Any) -> torch.Tensor:
        length = completion_mask.to(torch.float32).sum(dim=1)  # (B,)
        free = self.max_completion_length - self.soft_punish_cache
        ramp = (free - length) / self.soft_punish_cache  # (B,) in [-1, 0) on the soft band
        punishment = torch.where(length <= free, 0.0, torch.where(length <= self.max_completion_length, ramp, -1.0))
        return self.penalty * punishment


class TargetLengthReward(TensorReward):
    """``max(0, 1 - |len - target| / tolerance)``: 1.0 at the target length, falling linearly to 0 at
    ``target ± tolerance`` tokens.

    Args:
        target_length: an int for every sample, or the name of a per-sample column (ints, or a ``(B,)`` tensor).
        tolerance: tokens from the target at which the reward reaches 0 (default: the target itself, i.e. relative
            error; pass an int for an absolute band).
    """

    default_name = "target_length"

    def __init__(self, target_length: int | str, tolerance: float | None = None, name=None):
        if isinstance(target_length, int) and target_length <= 0:
            raise ValueError(f"target_length must be a positive number of tokens, got {target_length}.")
        if tolerance is not None and tolerance <= 0:
            raise ValueError(f"tolerance must be positive, got {tolerance}.")
        super().__init__(None, None, name)
        self.target_length = target_length
        self.tolerance = tolerance

    def score(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, **columns: Any) -> torch.Tensor:
        length = completion_mask.to(torch.float64).sum(dim=1)  # (B,)
        if isinstance(self.target_length, str):
            if self.target_length not in columns:
                raise KeyError(f"{self.__name__} needs the column {self.target_length!r}; got {sorted(columns)}.")
            target = column_tensor(columns[self.target_length], length.device, float, length.shape[0])  # (B,)
        else:
            target = torch.full_like(length, float(self.target_length))
        tolerance = target if self.tolerance is None else torch.full_like(length, float(self.tolerance))
        return (1.0 - (length - target).abs() / tolerance.clamp(min=1.0)).clamp(min=0.0).to(torch.float32)
