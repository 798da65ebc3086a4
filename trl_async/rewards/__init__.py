"""Tensor-native rewards: TRL reward functions computed on token ids, vectorised, without decoding.

Every reward here is both a TRL reward function (``reward(prompts, completions, completion_ids, **columns)``,
usable in stock ``trl.GRPOTrainer``) and a tensor reward (``reward.score(completion_ids, completion_mask,
**columns) -> (B,)`` on the ids' device), which ``trl_async`` trainers call on the device batch.

* :class:`MathAnswerReward` — the final answer (last ``\\boxed{}``, ``#### N`` or last number) equals the target.
* :class:`TokenPatternReward` — a per-sample token sequence at the end / inside the answer span / anywhere.
* :class:`FormatReward` — ``<think>…</think><answer>…</answer>`` (or other tag pairs).
* :class:`SoftOverlongPunishment`, :class:`TargetLengthReward` — from the mask alone.
* :class:`TensorReward` (subclass it), :func:`tensor_reward` (decorate a function), :class:`WeightedSum` /
  :func:`combine` (a weighted sum as one reward).
"""

from .base import FunctionReward, TensorReward, WeightedSum, combine, pad_right, tensor_reward
from .format import FormatReward, format_matches
from .length import SoftOverlongPunishment, TargetLengthReward
from .math_answer import MathAnswerReward, final_answer, parse_number, target_value
from .token_pattern import TokenPatternReward
from .vocab_tables import VocabTables

__all__ = [
    "FormatReward",
    "FunctionReward",
    "MathAnswerReward",
    "SoftOverlongPunishment",
    "TargetLengthReward",
    "TensorReward",
    "TokenPatternReward",
    "VocabTables",
    "WeightedSum",
    "combine",
    "final_answer",
    "format_matches",
    "pad_right",
    "parse_number",
    "target_value",
    "tensor_reward",
]
