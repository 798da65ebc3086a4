"""M2PO, second-moment trust policy optimization (Zheng, Zhao & Chen 2025, https://arxiv.org/abs/2510.01161), as
pure tensor functions. The trainer (:mod:`trl_async.async_m2po_trainer`) only wires them to TRL.

In the paper's order and names, for every valid completion token ``t`` sampled by the behaviour policy:

    log_ratio_t = log pi_theta(o_t) - log pi_behav(o_t)
    m2_t        = log_ratio_t ** 2
    M2          = mean_t m2_t                                   (over valid tokens)
    M_t         = 1 for all tokens if M2 <= tau, else 0 for the tokens with the largest m2_t, largest first,
                  until the mean m2 of the kept tokens is <= tau
    L(theta)    = - 1/Z * sum_t M_t * exp(log_ratio_t) * A_t   (no epsilon-clip; Z = the `loss_type` normaliser)

Invariants of :func:`second_moment_mask` (tested in ``tests/test_m2po.py``):

* it keeps only valid tokens with a finite ``log_ratio``, and keeps at least one when any exists;
* the mean ``m2`` of the kept tokens is ``<= tau``, except when even the smallest ``m2`` exceeds ``tau``: then only
  the tokens with the smallest ``m2`` are kept;
* every masked valid token has ``m2 >=`` every kept token's ``m2`` (the masked tokens are exactly the largest), and
  as few are masked as this allows;
* the mask depends only on the values, not on their order: equal ``m2`` values are kept or masked together (so every
  process and every shuffle gets the same mask). On a tie across the cut this masks the whole tie, one or a few more
  tokens than a count-based cut would;
* vectorised: one sort of the candidates (``m2 > tau``), one cumulative sum, no Python loop over tokens.

:func:`aggregate_loss` reproduces TRL 1.16's ``loss_type`` normalisers (``GRPOTrainer._compute_loss``), including
its division by the gradient-accumulation steps.
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")


def _accumulation_dtype(device: torch.device) -> torch.dtype:
    # float64 sums keep `kept mean <= tau` exact to ~1e-16 over a million tokens; MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


def second_moment_mask(log_ratio: torch.Tensor, valid_mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool mask (same shape as ``log_ratio``) of the tokens M2PO keeps: the largest set ``{m2 < v}`` of valid tokens
    whose mean ``m2 = log_ratio**2`` is ``<= threshold`` (all valid tokens when ``M2 <= threshold``); when that set
    is empty, the tokens with the smallest ``m2``. Tokens outside ``valid_mask`` or with a non-finite ``log_ratio``
    are never kept. ``threshold`` is the paper's ``tau`` (``m2_threshold``); ``float("inf")`` keeps every valid token.

    Only tokens with ``m2 > threshold`` can be masked (once they are all gone the rest has mean ``<= threshold``), so
    only they are sorted: one boolean selection (a host sync for its size) and one sort of the candidates.
    """
    if log_ratio.shape != valid_mask.shape:
        raise ValueError(f"log_ratio {tuple(log_ratio.shape)} and valid_mask {tuple(valid_mask.shape)} differ.")
    valid = valid_mask.bool() & torch.isfinite(log_ratio)  # (...)
    m2_tok = torch.where(valid, log_ratio.detach().float().square(), 0.0)  # (...) elementwise in float32
    candidate = valid & (m2_tok > threshold)  # (...) the only tokens that can be masked
    sorted_m2 = torch.sort(m2_tok[candidate], descending=True).values  # (C,) largest first
    if sorted_m2.numel() == 0:
        return valid  # every m2 <= tau, so M2 <= tau
    acc = _accumulation_dtype(log_ratio.device)  # float64 sums of the float32 squares: `kept mean <= tau` to ~1e-16
    low_sum = torch.where(candidate, 0.0, m2_tok).sum(dtype=acc)  # m2_tok is 0 on invalid tokens
    num_low = valid.sum() - sorted_m2.numel()
    # suffix_mean[i]: mean m2 of the valid tokens left after masking sorted_m2[:i]; summed from the smallest up
    suffix_sum = low_sum + sorted_m2.to(acc).flip(0).cumsum(0).flip(0)  # (C,)
    suffix_count = num_low + torch.arange(sorted_m2.numel(), 0, -1, device=sorted_m2.device)  # (C,)
    # suffix means fall as i grows, so the tokens to mask are the first k, k = #{i : suffix_mean[i] > tau}
    num_over = (suffix_sum / suffix_count > threshold).sum()
    cutoff = sorted_m2[(num_over - 1).clamp(min=0)]  # smallest m2 that must go (with its ties)
    only_smallest = (num_low == 0) & (m2_tok <= sorted_m2[-1])  # nothing fits under tau: keep the smallest m2
    return valid & ((num_over == 0) | (m2_tok < cutoff) | only_smallest)


def harmful_quadrant(log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Tokens whose ratio pushes the update the way the advantage already does: ``A>0 & r>1`` or ``A<0 & r<1``."""
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
    return ((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0))


def harmful_second_moment_mask(
    log_ratio: torch.Tensor, valid_mask: torch.Tensor, advantages: torch.Tensor, threshold: float
) -> torch.Tensor:
    """M2PO restricted to the harmful quadrants (the authors' code, Infini-AI-Lab/M2PO): the second moment is taken
    over the harmful tokens only and only they can be masked; every other valid, finite token is kept."""
    valid = valid_mask.bool() & torch.isfinite(log_ratio)
    harmful = valid & harmful_quadrant(log_ratio, advantages)  # (B, T)
    return (valid & ~harmful) | second_moment_mask(log_ratio, harmful, threshold)


def masked_second_moment(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mean(log_ratio**2)`` over ``mask`` (finite values only); 0 when nothing is selected. A 0-dim float tensor."""
    mask = mask.bool() & torch.isfinite(log_ratio)
    m2_tok = torch.where(mask, log_ratio.detach().to(_accumulation_dtype(log_ratio.device)).square(), 0.0)
    return (m2_tok.sum() / mask.sum().clamp(min=1)).float()


def m2po_per_token_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    keep_mask: torch.Tensor,
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
) -> torch.Tensor:
    """Per-token M2PO loss ``-(M * exp(log_ratio) * A)``, shape ``(B, T)``.

    ``log_ratio`` carries the gradient (current minus behaviour log-probs); masked tokens give exactly zero loss and
    zero gradient, even where ``log_ratio`` is not finite. With ``epsilon_low``/``epsilon_high`` set, the kept tokens
    use PPO's clipped surrogate ``-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`` instead (off by default, as in the paper).
    """
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
    keep = keep_mask.bool()
    ratio = torch.exp(torch.where(keep, log_ratio, 0.0))  # (B, T) r_t, 1 on masked tokens
    if epsilon_low is None and epsilon_high is None:
        per_token_loss = -ratio * advantages
    else:
        low = 1 - (epsilon_low if epsilon_low is not None else float("inf"))
        high = 1 + (epsilon_high if epsilon_high is not None else float("inf"))
        per_token_loss = -torch.min(ratio * advantages, ratio.clamp(low, high) * advantages)
    return torch.where(keep, per_token_loss, 0.0)


def token_variant_per_token_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    valid_mask: torch.Tensor,
    gamma: float,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The seed page's per-token rule, kept only to compare against (it never uses the second moment it names):
    ``m_t = 1[r_t**2 <= gamma]`` and ``-m_t * min(r_t*A, clip(r_t, 1-eps_low, 1+eps_high)*A)`` per token.

    Returns ``(per_token_loss (B, T), keep (B, T) bool, clipped (B, T) bool)``; ``clipped`` marks kept tokens where
    the clipped branch of the min is the active one. Normalise with ``aggregate_loss(..., mask=keep)`` for the seed's
    ``1/Z_m`` (``Z_m`` = number of kept tokens).
    """
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
    finite = torch.isfinite(log_ratio)
    safe_log_ratio = torch.where(finite, log_ratio, 0.0)
    ratio = torch.exp(safe_log_ratio)  # (B, T)
    keep = valid_mask.bool() & finite & (ratio.detach().square() <= gamma)
    unclipped = ratio * advantages
    clipped_term = ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * advantages
    per_token_loss = torch.where(keep, -torch.min(unclipped, clipped_term), 0.0)
    clipped = keep & (clipped_term.detach() < unclipped.detach())
    return per_token_loss, keep, clipped


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    training: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce a ``(B, T)`` (or ``(B, 1)``) per-token loss to a scalar exactly as TRL 1.16's ``_compute_loss`` does.

    Returns ``(loss, policy_loss)``: ``loss`` is what to backpropagate (already divided by the gradient-accumulation
    steps in training, as TRL does), ``policy_loss`` the detached value before that division. ``mask`` selects the
    tokens that count (numerator and token-count denominators). Normalisers, with ``GA`` the accumulation steps
    (1 in eval):

    * ``grpo``, ``sapo``: mean over sequences of (sum over the sequence's tokens / its token count), / GA;
    * ``bnpo``: sum / total token count, / GA;  ``dr_grpo``: sum / (B * max_completion_length), / GA;
    * ``luspo``: mean over sequences of the per-sequence sum, / GA;
    * ``dapo``, ``cispo``, ``vespo``: sum / (num_items_in_batch / num_processes * GA / steps_per_generation);
      ``num_items_in_batch`` counts the tokens of the whole generation batch over all processes (in eval: sum /
      (num_items_in_batch / num_processes)).
    """
    mask = mask.to(per_token_loss.dtype)
    accumulation = gradient_accumulation_steps if training else 1
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError(
                "loss_type='dr_grpo' normalises by B * max_completion_length; pass max_completion_length."
            )
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean()
    elif loss_type in ("dapo", "cispo", "vespo"):
        if num_items_in_batch is None:
            raise ValueError(f"loss_type={loss_type!r} normalises by num_items_in_batch; pass it.")
        normalizer = torch.as_tensor(num_items_in_batch, dtype=per_token_loss.dtype, device=per_token_loss.device)
        normalizer = normalizer.clamp(min=1.0) / num_processes
        if training:
            normalizer = normalizer * gradient_accumulation_steps / steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer
        return loss, loss.detach()  # TRL's window-rescaled normaliser already accounts for accumulation
    else:
        raise ValueError(f"Unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}.")
    return loss / accumulation, loss.detach()
