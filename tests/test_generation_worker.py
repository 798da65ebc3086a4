"""GenerationWorker: versions, bounded lookahead, failure propagation and shutdown (seam tests).

The engine here is a tiny deterministic stand-in *for the seam only*; the real engines are tested in
test_hf_engine.py (transformers) and test_vllm_engine.py (vLLM), and end to end in test_async_grpo_trainer.py.
"""

import itertools
import threading
import time

import pytest

from trl_async.engines.base import EngineOutput
from trl_async.generation_worker import GenerationWorker, GenerationWorkerError
from trl_async.replay_buffer import VersionedReplayBuffer


class CountingEngine:
    """Completion = [weights_value, prompt_len]; log-probs = [-1.0, -1.0]."""

    def __init__(self, fail_on_call: int | None = None, load_delay: float = 0.0):
        self.weights_value = 0
        self.calls = 0
        self.fail_on_call = fail_on_call
        self.load_delay = load_delay

    def generate(self, prompt_ids, num_generations):
        self.calls += 1
        if self.fail_on_call is not None and self.calls == self.fail_on_call:
            raise ValueError("boom in engine")
        rows = [[self.weights_value, len(p)] for p in prompt_ids for _ in range(num_generations)]
        return EngineOutput(completion_ids=rows, logprobs=[[-1.0, -1.0] for _ in rows])

    def stage_weights(self, model):
        return model

    def load_weights(self, update):
        time.sleep(self.load_delay)
        self.weights_value = update

    def close(self):
        pass


def prompt_stream(per_call=2):
    counter = itertools.count()
    while True:
        yield [{"prompt": f"prompt {next(counter)}"} for _ in range(per_call)]


def make_worker(engine, buffer, max_staleness, planned=lambda k: k):
    return GenerationWorker(
        engine=engine,
        prompt_rows=prompt_stream(),
        tokenize=lambda prompts: [[1] * len(p) for p in prompts],
        buffer=buffer,
        num_generations=3,
        planned_version=planned,
        max_staleness=max_staleness,
    )


def test_groups_are_whole_and_tagged_with_the_engine_version():
    buffer = VersionedReplayBuffer(capacity=4, max_staleness=5)
    engine = CountingEngine()
    worker = make_worker(engine, buffer, max_staleness=5)
    worker.start()
    try:
        groups = buffer.get(2, trainer_version=0, timeout=5)
        assert all(len(g.completion_ids) == 3 for g in groups)
        assert all(g.policy_version == 0 for g in groups)
        assert groups[0].row["prompt"] == "prompt 0"
    finally:
        worker.stop()
    assert not worker.is_alive()


def test_max_staleness_zero_waits_for_the_planned_weights():
    """With max_staleness=0, call k starts only with version k: every rollout is on-policy."""
    buffer = VersionedReplayBuffer(capacity=2, max_staleness=0)
    engine = CountingEngine()
    worker = make_worker(engine, buffer, max_staleness=0)
    worker.start()
    try:
        for version in range(4):
            if version > 0:
                worker.push_weights(version, version)  # the trainer syncs, then waits for rollouts
            groups = buffer.get(2, trainer_version=version, timeout=5)
            assert {g.policy_version for g in groups} == {version}
            assert {tuple(c) for g in groups for c in g.completion_ids} == {(version, 8)}  # generated with them
            time.sleep(0.05)
            assert len(buffer) == 0, "the worker must not run ahead of the weights it is allowed to use"
        assert buffer.evicted_stale == 0
    finally:
        worker.stop()


def test_lookahead_is_bounded_by_max_staleness():
    buffer = VersionedReplayBuffer(capacity=100, max_staleness=2)
    worker = make_worker(CountingEngine(), buffer, max_staleness=2)
    worker.start()
    try:
        time.sleep(0.3)
        assert worker.calls_done == 3  # calls 0, 1, 2 may use version 0; call 3 needs version >= 1
        worker.push_weights(1, 1)
        time.sleep(0.3)
        assert worker.calls_done == 4
    finally:
        worker.stop()


def test_version_advances_only_after_the_engine_loaded_the_weights():
    buffer = VersionedReplayBuffer(capacity=100, max_staleness=0)
    engine = CountingEngine(load_delay=0.3)
    worker = make_worker(engine, buffer, max_staleness=0)
    worker.start()
    try:
        buffer.get(2, trainer_version=0, timeout=5)
        worker.push_weights(1, 1)
        time.sleep(0.1)
        assert worker.policy_version == 0  # still loading
        groups = buffer.get(2, trainer_version=1, timeout=5)
        assert worker.policy_version == 1
        assert all(c[0] == 1 for g in groups for c in g.completion_ids)
    finally:
        worker.stop()


def test_engine_error_reaches_the_consumer_promptly_with_traceback():
    buffer = VersionedReplayBuffer(capacity=100, max_staleness=10)
    worker = make_worker(CountingEngine(fail_on_call=2), buffer, max_staleness=10)
    worker.start()
    start = time.monotonic()
    with pytest.raises(GenerationWorkerError, match="boom in engine") as info:
        while True:
            buffer.get(2, trainer_version=0, timeout=5, on_wait=worker.raise_if_failed)
            worker.raise_if_failed()
    assert time.monotonic() - start < 3
    assert isinstance(info.value.__cause__, ValueError)
    assert "generate" in str(info.value)  # the worker's traceback is in the message
    worker.join(2)
    assert not worker.is_alive()


def test_stop_unblocks_a_worker_blocked_on_a_full_buffer():
    buffer = VersionedReplayBuffer(capacity=2, max_staleness=10)
    worker = make_worker(CountingEngine(), buffer, max_staleness=10)
    worker.start()
    time.sleep(0.2)  # buffer full, worker blocked in put
    start = time.monotonic()
    worker.stop(timeout=5)
    assert time.monotonic() - start < 2
    assert not worker.is_alive()
    assert "trl_async-generation-worker" not in [t.name for t in threading.enumerate()]


def test_stop_unblocks_a_worker_waiting_for_weights():
    buffer = VersionedReplayBuffer(capacity=100, max_staleness=0)
    worker = make_worker(CountingEngine(), buffer, max_staleness=0)
    worker.start()
    time.sleep(0.2)  # call 1 waits for version 1
    worker.stop(timeout=5)
    assert not worker.is_alive()
