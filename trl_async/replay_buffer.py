"""A bounded, thread-safe FIFO of GRPO groups tagged with the policy version that generated them.

Invariants (tested in ``tests/test_replay_buffer.py``):

1. Every group that enters leaves exactly once: taken for training, or evicted as stale (counted in
   ``evicted_stale``). ``total_put == total_taken + evicted_stale + len(buffer)`` at all times.
2. A group (the ``num_generations`` completions of one prompt) is atomic: it is put, evicted and taken whole.
3. ``staleness = trainer_version - policy_version``; :meth:`VersionedReplayBuffer.get` never returns a group whose
   staleness exceeds ``max_staleness``.
4. Back-pressure, never silent loss: :meth:`put` blocks while the buffer is full. :meth:`close` wakes every waiter;
   after it, :meth:`put` and :meth:`get` raise :class:`BufferClosed` (carrying the producer's error, if any).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def staleness(trainer_version: int, policy_version: int) -> int:
    """How many optimizer steps the policy has taken since the one that generated a rollout."""
    return trainer_version - policy_version


def is_stale(trainer_version: int, policy_version: int, max_staleness: int) -> bool:
    """True when a rollout is too old to train on (``staleness > max_staleness``)."""
    return staleness(trainer_version, policy_version) > max_staleness


@dataclass
class RolloutGroup:
    """The ``num_generations`` completions of one prompt, all sampled from policy ``policy_version``."""

    row: dict[str, Any]  # the dataset row: "prompt" plus every other column (rewards read them)
    prompt_ids: list[int]
    completion_ids: list[list[int]]  # G ragged rows, EOS included when generated
    logprobs: list[list[float]]  # G ragged rows: behaviour log-prob of each sampled token
    policy_version: int
    batch_index: int = 0  # which generation call produced it
    generation_s: float = 0.0  # wall time of that generation call
    created_at: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        if len(self.completion_ids) != len(self.logprobs):
            raise ValueError(
                f"A group needs one log-prob row per completion: got {len(self.completion_ids)} completions and "
                f"{len(self.logprobs)} log-prob rows."
            )
        for ids, lps in zip(self.completion_ids, self.logprobs):
            if len(ids) != len(lps):
                raise ValueError(f"Completion of {len(ids)} tokens has {len(lps)} behaviour log-probs.")


class BufferClosed(RuntimeError):
    """Raised by :meth:`VersionedReplayBuffer.put` / :meth:`~VersionedReplayBuffer.get` after :meth:`close`."""


class VersionedReplayBuffer:
    """FIFO of :class:`RolloutGroup` with capacity ``capacity`` groups and staleness eviction at :meth:`get`."""

    def __init__(self, capacity: int, max_staleness: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 group, got {capacity}.")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}.")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self._groups: deque[RolloutGroup] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self.total_put = 0
        self.total_taken = 0
        self.evicted_stale = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, groups: list[RolloutGroup], timeout: float | None = None) -> None:
        """Append ``groups`` atomically, blocking while they do not fit. Raises ``TimeoutError`` after ``timeout``."""
        if len(groups) > self.capacity:
            raise ValueError(f"Cannot put {len(groups)} groups into a buffer of capacity {self.capacity}.")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed and len(self._groups) + len(groups) > self.capacity:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"Replay buffer stayed full ({self.capacity} groups) for {timeout} s.")
                self._cond.wait(remaining)
            self._raise_if_closed()
            self._groups.extend(groups)
            self.total_put += len(groups)
            self._cond.notify_all()

    def get(
        self,
        num_groups: int,
        trainer_version: int,
        timeout: float | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> list[RolloutGroup]:
        """Take the ``num_groups`` oldest groups with ``staleness <= max_staleness``, evicting staler ones.

        Blocks until enough fresh groups are there. ``on_wait`` is called about every 0.1 s while waiting (the
        trainer uses it to check that the producer is alive). Raises ``TimeoutError`` after ``timeout`` seconds.
        """
        if num_groups > self.capacity:
            raise ValueError(f"Cannot get {num_groups} groups from a buffer of capacity {self.capacity}.")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._evict_stale(trainer_version)
                if len(self._groups) >= num_groups:
                    taken = [self._groups.popleft() for _ in range(num_groups)]
                    self.total_taken += num_groups
                    self._cond.notify_all()  # room for the producer
                    return taken
                self._raise_if_closed()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"No rollouts for {timeout} s: the buffer holds {len(self._groups)} of the {num_groups} "
                        "groups the trainer needs. Raise `generation_timeout_s` if generation is this slow."
                    )
                self._cond.wait(0.1 if remaining is None else min(0.1, remaining))
                if on_wait is not None:
                    self._cond.release()
                    try:
                        on_wait()
                    finally:
                        self._cond.acquire()

    def close(self, error: BaseException | None = None) -> None:
        """Wake every waiter; later ``put``/``get`` raise :class:`BufferClosed` (from ``error`` when given)."""
        with self._cond:
            self._closed = True
            if error is not None and self._error is None:
                self._error = error
            self._cond.notify_all()

    def _evict_stale(self, trainer_version: int) -> None:
        fresh = deque(g for g in self._groups if not is_stale(trainer_version, g.policy_version, self.max_staleness))
        evicted = len(self._groups) - len(fresh)
        if evicted:
            self.evicted_stale += evicted
            self._groups = fresh
            self._cond.notify_all()

    def _raise_if_closed(self) -> None:
        if self._closed:
            if self._error is not None:
                raise BufferClosed("The rollout producer failed; see the error above.") from self._error
            raise BufferClosed("The replay buffer is closed.")
