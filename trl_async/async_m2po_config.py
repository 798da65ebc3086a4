"""Configuration of :class:`~trl_async.AsyncM2POTrainer`: every ``AsyncGRPOConfig`` field, plus the off-policy
correction selector and the M2PO knobs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .async_grpo_config import AsyncGRPOConfig

OFF_POLICY_CORRECTIONS = ("m2po", "tis", "mis", "none")
OFF_POLICY_LEVELS = ("token", "sequence")
M2PO_VARIANTS = ("second_moment", "token")
M2PO_DENOMINATORS = ("valid", "kept")


@dataclass
class AsyncM2POConfig(AsyncGRPOConfig):
    r"""
    [`AsyncGRPOConfig`] for [`AsyncM2POTrainer`]: one selector picks how stale rollouts are corrected, so every
    correction runs in the same trainer on equal terms. Only the fields below are new.

    The selector owns TRL's `vllm_importance_sampling_correction` and `vllm_importance_sampling_mode` (they are set
    in `__post_init__`); `vllm_importance_sampling_clip_min`/`_max` stay yours and bound TIS/MIS.

    Parameters:
        off_policy_correction (`str`, *optional*, defaults to `"m2po"`):
            - `"m2po"`: the M2PO loss (arXiv 2510.01161), see `m2po_variant`.
            - `"tis"` / `"mis"`: TRL's own truncated / masked importance sampling of the proximal-vs-behaviour ratio
              (`vllm_importance_sampling_mode="{level}_truncate"` / `"{level}_mask"`), on top of TRL's loss.
            - `"none"`: TRL's loss with its PPO ratio taken against the behaviour log-probs (plain clip).
        off_policy_level (`str`, *optional*, defaults to `"token"`):
            `"token"` or `"sequence"` importance ratios for `"tis"`/`"mis"`.
        m2po_variant (`str`, *optional*, defaults to `"second_moment"`):
            `"second_moment"`: the paper's batch second-moment mask, importance-weighted PG without clip.
            `"token"`: the seed page's per-token rule `r**2 <= m2po_gamma` inside PPO clipping (uses `epsilon` and
            `epsilon_high`), kept only to compare with its published figures; it is not M2PO.
        m2_threshold (`float`, *optional*, defaults to `0.04`):
            The paper's `tau`: mask the largest `log_ratio**2` until the kept tokens' mean is `<= m2_threshold`.
            `float("inf")` disables masking (unclipped importance-weighted policy gradient).
        m2po_harmful_only (`bool`, *optional*, defaults to `False`):
            Measure and mask only tokens in the harmful quadrants (`A>0 & r>1`, `A<0 & r<1`), as the authors' code.
        m2po_denominator (`str`, *optional*, defaults to `"valid"`):
            `"valid"`: the `loss_type` normaliser counts every valid completion token (the paper's `1/sum|o_i|`);
            masked tokens add zero policy loss. `"kept"`: masked tokens leave the loss entirely (also its KL term) and
            the normaliser counts kept tokens only.
        m2po_epsilon (`float` or `None`, *optional*, defaults to `None`):
            If set, kept tokens use PPO's clipped surrogate with `clip(r, 1 - m2po_epsilon, 1 + m2po_epsilon)`.
            `None` (the paper): no epsilon-clip.
        m2po_gamma (`float`, *optional*, defaults to `2.0`):
            `m2po_variant="token"` only: the seed's per-token bound on `r**2`.
    """

    off_policy_correction: str = field(
        default="m2po",
        metadata={"help": "How stale rollouts are corrected.", "choices": list(OFF_POLICY_CORRECTIONS)},
    )
    off_policy_level: str = field(
        default="token",
        metadata={"help": "Importance-ratio level for 'tis'/'mis'.", "choices": list(OFF_POLICY_LEVELS)},
    )
    m2po_variant: str = field(
        default="second_moment",
        metadata={
            "help": "'second_moment' = M2PO (paper); 'token' = the seed page's r**2 <= gamma rule, for comparison.",
            "choices": list(M2PO_VARIANTS),
        },
    )
    m2_threshold: float = field(
        default=0.04,
        metadata={"help": "M2PO tau: bound on the mean log_ratio**2 of the kept tokens. inf disables masking."},
    )
    m2po_harmful_only: bool = field(
        default=False,
        metadata={"help": "Restrict M2PO masking to the harmful quadrants (A>0 & r>1, A<0 & r<1)."},
    )
    m2po_denominator: str = field(
        default="valid",
        metadata={
            "help": "Tokens the loss_type normaliser counts: all 'valid' tokens (paper) or only 'kept' ones.",
            "choices": list(M2PO_DENOMINATORS),
        },
    )
    m2po_epsilon: float | None = field(
        default=None,
        metadata={"help": "Optional PPO clip of kept tokens' ratio to [1-eps, 1+eps]. None (paper): no clip."},
    )
    m2po_gamma: float = field(
        default=2.0,
        metadata={"help": "m2po_variant='token' only: the seed's per-token bound r**2 <= gamma."},
    )

    def __post_init__(self):
        _check_choice("off_policy_correction", self.off_policy_correction, OFF_POLICY_CORRECTIONS)
        _check_choice("off_policy_level", self.off_policy_level, OFF_POLICY_LEVELS)
        _check_choice("m2po_variant", self.m2po_variant, M2PO_VARIANTS)
        _check_choice("m2po_denominator", self.m2po_denominator, M2PO_DENOMINATORS)
        if math.isnan(self.m2_threshold) or self.m2_threshold < 0:
            raise ValueError(
                f"m2_threshold is a bound on a mean of squares: use a value >= 0, got {self.m2_threshold}."
            )
        if self.m2po_epsilon is not None and not 0 < self.m2po_epsilon:
            raise ValueError(f"m2po_epsilon must be > 0 or None (no clip), got {self.m2po_epsilon}.")
        if not self.m2po_gamma > 0:
            raise ValueError(f"m2po_gamma bounds r**2 and must be > 0, got {self.m2po_gamma}.")
        if self.off_policy_correction == "m2po":
            self._check_m2po_compatible()
        # Map the selector onto TRL's importance-sampling fields (TRL's implementation does TIS/MIS).
        if self.off_policy_correction in ("tis", "mis"):
            suffix = "truncate" if self.off_policy_correction == "tis" else "mask"
            self.vllm_importance_sampling_correction = True
            self.vllm_importance_sampling_mode = f"{self.off_policy_level}_{suffix}"
        elif self.off_policy_correction == "m2po" and self.m2po_variant == "second_moment":
            # TRL then scores stale batches with the current (proximal) policy, which the M2PO mask needs; the
            # M2PO loss never multiplies by TRL's resulting ratio (it is only logged under sampling/*).
            self.vllm_importance_sampling_correction = True
            self.vllm_importance_sampling_mode = "token_truncate"
        else:  # "none", and the token variant (ratio against behaviour only)
            self.vllm_importance_sampling_correction = False
        super().__post_init__()

    def _check_m2po_compatible(self) -> None:
        unsupported = {
            "top_entropy_quantile < 1": self.top_entropy_quantile < 1.0,
            "entropy_coef != 0 or use_adaptive_entropy": self.entropy_coef != 0.0 or self.use_adaptive_entropy,
            "off_policy_mask_threshold": self.off_policy_mask_threshold is not None,
            "importance_sampling_level='sequence'": self.importance_sampling_level != "token",
            "delta (two-sided clipping)": self.delta is not None,
        }
        bad = [name for name, is_set in unsupported.items() if is_set]
        if bad:
            raise ValueError(
                f"The M2PO loss is token-level and does not implement {', '.join(bad)}. Unset them, or choose "
                "off_policy_correction='tis' / 'mis' / 'none', which run TRL's own loss with all its options."
            )


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")
