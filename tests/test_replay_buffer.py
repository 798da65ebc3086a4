"""VersionedReplayBuffer: the invariants in its module docstring."""

import random
import threading
import time

import pytest

from trl_async.replay_buffer import BufferClosed, RolloutGroup, VersionedReplayBuffer, is_stale, staleness


def group(version: int, tag: int = 0, g: int = 2) -> RolloutGroup:
    return RolloutGroup(
        row={"prompt": f"p{tag}", "tag": tag},
        prompt_ids=[1, 2],
        completion_ids=[[tag, 7] for _ in range(g)],
        logprobs=[[-0.1, -0.2] for _ in range(g)],
        policy_version=version,
    )


def test_staleness_is_trainer_minus_policy_version():
    assert staleness(5, 3) == 2
    assert staleness(3, 3) == 0
    assert not is_stale(5, 3, max_staleness=2)
    assert is_stale(6, 3, max_staleness=2)
    assert is_stale(1, 0, max_staleness=0)
    assert not is_stale(0, 0, max_staleness=0)


def test_group_rejects_mismatched_logprobs():
    with pytest.raises(ValueError, match="log-prob"):
        RolloutGroup(row={}, prompt_ids=[1], completion_ids=[[1, 2]], logprobs=[[-1.0]], policy_version=0)
    with pytest.raises(ValueError, match="one log-prob row per completion"):
        RolloutGroup(row={}, prompt_ids=[1], completion_ids=[[1], [2]], logprobs=[[-1.0]], policy_version=0)


def test_fifo_and_groups_stay_whole():
    buf = VersionedReplayBuffer(capacity=8, max_staleness=3)
    buf.put([group(0, tag=i) for i in range(3)])
    taken = buf.get(2, trainer_version=0)
    assert [t.row["tag"] for t in taken] == [0, 1]
    assert all(len(t.completion_ids) == 2 and len(t.logprobs) == 2 for t in taken)
    assert len(buf) == 1


def test_stale_groups_are_evicted_counted_and_never_returned():
    buf = VersionedReplayBuffer(capacity=8, max_staleness=1)
    buf.put([group(0, tag=0), group(1, tag=1), group(3, tag=2), group(3, tag=3)])
    taken = buf.get(2, trainer_version=3)  # versions 0 and 1 are 3 and 2 steps stale
    assert [t.row["tag"] for t in taken] == [2, 3]
    assert buf.evicted_stale == 2
    assert buf.total_put == buf.total_taken + buf.evicted_stale + len(buf)


def test_max_staleness_zero_only_returns_current_version():
    buf = VersionedReplayBuffer(capacity=4, max_staleness=0)
    buf.put([group(4), group(5)])
    taken = buf.get(1, trainer_version=5)
    assert taken[0].policy_version == 5
    assert buf.evicted_stale == 1


def test_put_blocks_when_full_until_get_makes_room():
    buf = VersionedReplayBuffer(capacity=2, max_staleness=10)
    buf.put([group(0, 0), group(0, 1)])
    done = threading.Event()

    def producer():
        buf.put([group(0, 2)])
        done.set()

    thread = threading.Thread(target=producer)
    thread.start()
    assert not done.wait(0.3), "put must block while the buffer is full"
    buf.get(1, trainer_version=0)
    assert done.wait(2.0)
    thread.join()
    assert [g.row["tag"] for g in buf.get(2, trainer_version=0)] == [1, 2]


def test_put_times_out_instead_of_hanging():
    buf = VersionedReplayBuffer(capacity=1, max_staleness=0)
    buf.put([group(0)])
    with pytest.raises(TimeoutError):
        buf.put([group(0)], timeout=0.2)


def test_get_times_out_with_a_clear_message():
    buf = VersionedReplayBuffer(capacity=4, max_staleness=0)
    with pytest.raises(TimeoutError, match="generation_timeout_s"):
        buf.get(1, trainer_version=0, timeout=0.2)


def test_oversized_requests_are_rejected():
    buf = VersionedReplayBuffer(capacity=2, max_staleness=0)
    with pytest.raises(ValueError):
        buf.put([group(0)] * 3)
    with pytest.raises(ValueError):
        buf.get(3, trainer_version=0)


def test_close_unblocks_waiters_and_carries_the_error():
    buf = VersionedReplayBuffer(capacity=2, max_staleness=0)
    errors = []

    def consumer():
        try:
            buf.get(1, trainer_version=0)
        except BufferClosed as e:
            errors.append(e)

    thread = threading.Thread(target=consumer)
    thread.start()
    time.sleep(0.1)
    buf.close(RuntimeError("engine exploded"))
    thread.join(2.0)
    assert not thread.is_alive()
    assert isinstance(errors[0].__cause__, RuntimeError)
    with pytest.raises(BufferClosed):
        buf.put([group(0)])


def test_on_wait_callback_can_abort_a_waiting_get():
    buf = VersionedReplayBuffer(capacity=2, max_staleness=0)

    def abort():
        raise KeyError("producer died")

    with pytest.raises(KeyError):
        buf.get(1, trainer_version=0, timeout=5.0, on_wait=abort)


def test_concurrent_producers_and_consumers_lose_nothing():
    """3 producers x 200 groups, 2 consumers; every group leaves exactly once (taken or evicted)."""
    buf = VersionedReplayBuffer(capacity=16, max_staleness=2)
    version = [0]
    taken, lock = [], threading.Lock()
    per_producer, producers = 200, 3
    stop = threading.Event()

    def producer(pid):
        rng = random.Random(pid)
        for i in range(per_producer):
            buf.put([group(version[0] - rng.randint(0, 3), tag=pid * 1000 + i)])

    def consumer():
        while not stop.is_set():
            try:
                got = buf.get(1, trainer_version=version[0], timeout=0.05)
            except TimeoutError:
                continue
            except BufferClosed:
                return
            with lock:
                taken.extend(got)
            version[0] += 1 if random.random() < 0.05 else 0

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(producers)]
    threads += [threading.Thread(target=consumer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads[:producers]:
        t.join(20)
    deadline = time.time() + 10
    while len(buf) and time.time() < deadline:
        time.sleep(0.01)
    stop.set()
    for t in threads[producers:]:
        t.join(5)
    assert buf.total_put == producers * per_producer
    assert buf.total_put == buf.total_taken + buf.evicted_stale + len(buf)
    tags = [g.row["tag"] for g in taken]
    assert len(tags) == len(set(tags)) == buf.total_taken  # nothing taken twice
