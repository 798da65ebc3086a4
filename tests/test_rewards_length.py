"""Length rewards from the mask alone; parity with TRL's soft overlong punishment."""

from __future__ import annotations

import pytest
import torch
from trl.rewards import get_soft_overlong_punishment

from tests.test_rewards_math import assert_vectorised
from trl_async.rewards import SoftOverlongPunishment, TargetLengthReward, pad_right


def test_soft_overlong_matches_trl():
    completion_ids = [[1] * n for n in [1, 50, 79, 80, 81, 90, 99, 100, 101, 140]]
    ours = SoftOverlongPunishment(max_completion_length=100, soft_punish_cache=20)
    theirs = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert ours(completion_ids=completion_ids) == pytest.approx(theirs(completion_ids=completion_ids))
    ids, mask = pad_right(completion_ids)
    assert ours.score(ids, mask).tolist() == pytest.approx(theirs(completion_ids=completion_ids))
    with pytest.raises(ValueError, match="soft_punish_cache"):
        SoftOverlongPunishment(10, 0)


def test_target_length_constant_and_per_sample():
    ids, mask = pad_right([[1] * n for n in [10, 5, 15, 30]])
    constant = TargetLengthReward(10)
    assert constant.score(ids, mask).tolist() == pytest.approx([1.0, 0.5, 0.5, 0.0])
    per_sample = TargetLengthReward("budget", tolerance=5)
    assert per_sample(completion_ids=[[1] * 10, [1] * 10], budget=[10, 13]) == pytest.approx([1.0, 0.4])
    ten_ids, ten_mask = ids[[0, 0]], mask[[0, 0]]  # two completions of 10 tokens
    assert per_sample.score(ten_ids, ten_mask, budget=torch.tensor([10, 13])).tolist() == pytest.approx([1.0, 0.4])


def test_length_rewards_are_vectorised_no_host_sync():
    ids, mask = pad_right([[1] * n for n in [3, 9]])
    for reward in [SoftOverlongPunishment(8, 4), TargetLengthReward(5)]:
        assert_vectorised(reward.score, ids, mask)
