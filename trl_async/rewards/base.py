"""The tensor-reward protocol: one ``score`` on the device batch, and TRL's call signature built on top of it.

A :class:`TensorReward` is two things at once:

* an ordinary TRL reward function: ``reward(prompts=..., completions=..., completion_ids=..., **columns)`` returns
  ``list[float]``, so it goes into stock ``trl.GRPOTrainer(reward_funcs=[...])`` unchanged (and TRL's
  ``reward_weights`` keep working);
* a tensor reward: ``reward.score(completion_ids, completion_mask, **columns)`` takes ``(B, L)`` ids and mask on any
  device and returns a ``(B,)`` float tensor on the same device. Our trainers call this directly on the padded
  batch, with no decode and no ``.tolist()``.

Invariants every subclass keeps (tested for each reward):

* ``__call__`` pads the ragged ``completion_ids`` lists and calls ``score``, so both paths agree exactly.
* ``score`` is vectorised: no Python loop over samples or tokens, no ``.item()``/``.tolist()``/``.cpu()``, no branch
  on tensor values (it traces with ``torch.compile(..., fullgraph=True)`` when its per-sample targets are tensors).
* ``score`` ignores columns it does not use (TRL passes every dataset column) and never returns NaN.
* Only tokens before the first EOS (and inside ``completion_mask``) are read.

Write your own by subclassing and implementing ``score`` (see :class:`FunctionReward` for the one-function form) and
combine rewards with :class:`WeightedSum`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .positions import Positions


class TensorReward:
    """Base class of tensor-native rewards (see the module docstring).

    Args:
        tokenizer: the tokenizer of the policy (needed by rewards that read text; length rewards take ``None``).
        eos_token_ids: ids that end a completion. Defaults to the tokenizer's EOS and pad ids.
        name: the ``__name__`` TRL logs the reward under (``rewards/<name>/mean``).
    """

    default_name = "tensor_reward"

    def __init__(self, tokenizer=None, eos_token_ids: Sequence[int] | None = None, name: str | None = None):
        self.tokenizer = tokenizer
        if eos_token_ids is None and tokenizer is not None:
            eos_token_ids = [i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None]
        self.eos_token_ids = sorted(set(eos_token_ids or []))
        self.__name__ = name or self.default_name

    # ---- the tensor path ------------------------------------------------------------------------------------------
    def score(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, **columns: Any) -> torch.Tensor:
        """Rewards of a padded batch: ``(B, L)`` ids and mask -> ``(B,)`` float32 on the same device."""
        raise NotImplementedError

    def before_eos(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
        """Positions inside the mask and strictly before the first EOS inside the mask. # (B, L) bool

        Arithmetic, not comparisons: on a CPU ``ids == eos``, ``argmax`` and ``<`` over the (B, L) batch each cost
        4-8x an int32 xor / cast / shift, and this runs for every reward on every batch."""
        keep = completion_mask.bool()
        length = completion_ids.shape[1]
        if not self.eos_token_ids or length == 0:  # (an empty batch has no EOS to look for)
            return keep
        ids = completion_ids.to(torch.int32)  # (B, L) (token ids fit in int32)
        is_eos = ~(ids ^ self.eos_token_ids[0]).bool()
        for eos_id in self.eos_token_ids[1:]:  # a fixed handful of ids, not a loop over data
            is_eos |= ~(ids ^ eos_id).bool()
        is_eos &= keep  # (B, L)
        small = torch.int16 if length < 2**14 else torch.int32
        axis = Positions.of(length, completion_ids.device, small)
        first = axis.first(is_eos)  # (B,) L when there is none
        before = (axis.at - first[:, None]) >> (torch.iinfo(small).bits - 1)  # (B, L) -1 before the first EOS, else 0
        return keep & before.bool()

    # ---- TRL's reward-function signature ----------------------------------------------------------------------------
    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
        """TRL's signature: ``completion_ids`` is a list of id lists (EOS included when present)."""
        if completion_ids is None:
            completion_ids = self._tokenize(completions)
        ids, mask = pad_right(completion_ids)
        return self.score(ids, mask, **kwargs).tolist()

    def _tokenize(self, completions) -> list[list[int]]:
        if self.tokenizer is None or completions is None:
            raise ValueError(f"{self.__name__} needs `completion_ids` (or `completions` and a tokenizer).")
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational or plain
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.__name__!r})"


def pad_right(rows: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged id lists -> ``(B, L)`` long ids and bool mask (host side, used by the TRL path only); ``L >= 1`` (a
    batch of empty completions gets one masked column)."""
    width = max((len(r) for r in rows), default=1) or 1
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, L)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)  # (B, L)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        mask[i, : len(row)] = True
    return ids, mask


def at_least_one_column(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` with one masked column added when ``L == 0`` (a batch of empty completions), so that the
    readers' reductions over ``L`` have something to reduce. A shape check, not a data-dependent branch."""
    if ids.shape[1] > 0:
        return ids, mask
    return torch.nn.functional.pad(ids, (0, 1)), torch.nn.functional.pad(mask, (0, 1))


def column_tensor(values: Any, device: torch.device, parse: Callable[[Any], float], batch: int) -> torch.Tensor:
    """A per-sample numeric column as a ``(B,)`` float64 tensor on ``device``.

    Tensors (and scalars) are used as given; lists are converted element by element with ``parse`` (callers cache it
    per value), so a dataset column of strings costs one parse per distinct string.
    """
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=torch.float64).expand(batch)
    if isinstance(values, (int, float)):
        return torch.full((batch,), float(values), dtype=torch.float64, device=device)
    if len(values) != batch:
        raise ValueError(f"A per-sample column has {len(values)} values for a batch of {batch} completions.")
    return torch.tensor([parse(v) for v in values], dtype=torch.float64).to(device)


class FunctionReward(TensorReward):
    """A tensor reward from one function ``fn(completion_ids, completion_mask, **columns) -> (B,) tensor``.

    ``fn`` receives the ids, and a mask already cut at the first EOS; it must follow the ``score`` invariants above.

    Example::

        def ends_with_period(ids, mask, **_):  # 1.0 when the last kept token is "."
            last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & mask  # (B, L)
            return ((ids == period_id) & last).any(1).float()

        reward = FunctionReward(ends_with_period, eos_token_ids=[tok.eos_token_id])
    """

    def __init__(self, fn: Callable[..., torch.Tensor], eos_token_ids: Sequence[int] | None = None, name=None):
        super().__init__(None, eos_token_ids, name or getattr(fn, "__name__", "function_reward"))
        self.fn = fn

    def score(self, completion_ids, completion_mask, **columns):
        keep = self.before_eos(completion_ids, completion_mask)  # (B, L)
        return self.fn(completion_ids, keep, **columns).to(torch.float32)


def tensor_reward(fn=None, *, eos_token_ids: Sequence[int] | None = None, name: str | None = None):
    """Decorator form of :class:`FunctionReward`: ``@tensor_reward(eos_token_ids=[2])`` over a score function."""

    def wrap(f):
        return FunctionReward(f, eos_token_ids=eos_token_ids, name=name)

    return wrap(fn) if fn is not None else wrap


class WeightedSum(TensorReward):
    """``sum_i weight_i * reward_i`` as one reward (one metric in TRL's logs).

    Prefer passing the rewards separately with ``GRPOConfig(reward_weights=...)`` when you want each logged; use this
    when one scalar is wanted (e.g. a reward that is itself a term of another). Every reward must have ``score``.
    """

    def __init__(self, rewards: Sequence[TensorReward], weights: Sequence[float] | None = None, name=None):
        weights = [1.0] * len(rewards) if weights is None else list(weights)
        if len(weights) != len(rewards) or not rewards:
            raise ValueError(f"Got {len(rewards)} rewards and {len(weights)} weights; give one weight per reward.")
        missing = [getattr(r, "__name__", repr(r)) for r in rewards if not callable(getattr(r, "score", None))]
        if missing:
            raise TypeError(f"WeightedSum needs tensor rewards (with `score`); {missing} have none.")
        super().__init__(None, None, name or "+".join(r.__name__ for r in rewards))
        self.rewards = list(rewards)
        self.weights = weights

    def score(self, completion_ids, completion_mask, **columns):
        total = torch.zeros(completion_ids.shape[0], dtype=torch.float32, device=completion_ids.device)  # (B,)
        for reward, weight in zip(self.rewards, self.weights):
            total = total + weight * reward.score(completion_ids, completion_mask, **columns)
        return total


def combine(rewards: Sequence[TensorReward], weights: Sequence[float] | None = None, name=None) -> WeightedSum:
    """Shorthand for :class:`WeightedSum`."""
    return WeightedSum(rewards, weights, name)
