"""The compiled CPU kernel of the boxed read (``last_box.c``): same results as the torch-op path, built and cached
once, optional (a clear fallback or error where it cannot be built), safe from several threads, traceable."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch

from tests.test_rewards_math import encode, fuzz_texts
from tests.test_rewards_tokenizers import merged_digit_tokenizer, smollm2_tokenizer
from trl_async.benchmarks.rewards import make_batch
from trl_async.rewards import MathAnswerReward, final_answer, native, pad_right


@pytest.fixture(autouse=True)
def _forget_the_library():
    """Tests here change $CC / the cache; every test starts and ends with the process's library unloaded."""
    native.reset()
    yield
    native.reset()


@pytest.fixture(scope="module")
def needs_compiler():
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine ($CC / cc): the kernel cannot be built (CI has gcc)")


def twins(tokenizer, **kwargs):
    """The same reward with the compiled kernel and with torch ops only."""
    compiled = MathAnswerReward(tokenizer, cpu_kernel=True, **kwargs)
    torch_ops = MathAnswerReward(tokenizer, cpu_kernel=False, **kwargs)
    assert compiled.kernel is not None and torch_ops.kernel is None
    return compiled, torch_ops


def assert_same_extract(compiled, torch_ops, ids, mask):
    value, found = compiled.extract(ids, mask)
    want_value, want_found = torch_ops.extract(ids, mask)
    assert torch.equal(found, want_found)
    assert torch.equal(value, want_value)
    return value, found


@pytest.mark.parametrize("which", ["qwen", "smollm2", "merged_digits"])
def test_kernel_equals_torch_ops_and_the_specification_on_fuzzed_text(which, qwen_tokenizer, needs_compiler):
    tokenizer = {"qwen": lambda: qwen_tokenizer, "smollm2": smollm2_tokenizer, "merged_digits": merged_digit_tokenizer}
    tokenizer = tokenizer[which]()
    texts = fuzz_texts("\\boxed{", 800, f"native-{which}")
    compiled, torch_ops = twins(tokenizer)
    ids, mask = pad_right(encode(tokenizer, texts), pad_id=tokenizer.pad_token_id)
    value, found = assert_same_extract(compiled, torch_ops, ids, mask)
    got = [v if f else None for v, f in zip(value.tolist(), found.tolist())]
    assert got == [final_answer(t) for t in texts]
    assert 100 < found.sum() < 700


def test_kernel_equals_torch_ops_on_the_benchmark_batch_and_odd_inputs(qwen_tokenizer, needs_compiler):
    compiled, torch_ops = twins(qwen_tokenizer)
    ids, mask, answers = make_batch(qwen_tokenizer, 64, 256, seed=3)
    _, found = assert_same_extract(compiled, torch_ops, ids, mask)
    assert 30 < found.sum() < 64
    assert torch.equal(compiled.score(ids, mask, answer=answers), torch_ops.score(ids, mask, answer=answers))
    vocab = compiled.tables.vocab_size
    holes = mask & (torch.rand(mask.shape, generator=torch.Generator().manual_seed(0)) > 0.03)  # masked-out tokens
    strange = ids.clone()
    strange[:, ::7] = -5  # ids outside the vocabulary read as nothing
    strange[:, 3::11] = vocab + 100
    no_eos = torch.where(ids == qwen_tokenizer.eos_token_id, 13, ids)  # "." instead of every EOS
    cases = [
        (ids, holes),
        (strange, mask),
        (no_eos, torch.ones_like(mask)),
        (ids.to(torch.int32), mask.to(torch.float32)),  # other dtypes
        (ids.t().contiguous().t(), mask.t().contiguous().t()),  # not contiguous
        (ids[:, :1], mask[:, :1]),  # L = 1
        (ids[:0], mask[:0]),  # B = 0
        (ids[:, :0], mask[:, :0]),  # L = 0
        (ids + 2**32, mask),  # ids past int32: outside the vocabulary, not wrapped into it
        (ids, mask[:1]),  # a (1, L) mask broadcasts
    ]
    assert not compiled.extract(ids + 2**32, mask)[1].any()
    for reward in (compiled, torch_ops):  # a mask of another length is an error on both paths
        with pytest.raises(RuntimeError, match="size"):
            reward.extract(ids, mask[:, :-2])
    for case_ids, case_mask in cases:
        assert_same_extract(compiled, torch_ops, case_ids, case_mask)
        columns = {"answer": answers[: case_ids.shape[0]]}
        assert torch.equal(
            compiled.score(case_ids, case_mask, **columns), torch_ops.score(case_ids, case_mask, **columns)
        )


def test_kernel_compares_with_the_target_as_torch_ops_do(qwen_tokenizer, needs_compiler):
    texts = ["\\boxed{72}", "\\boxed{-3.5}", "\\boxed{0.1}", "\\boxed{1,000.25}", "\\boxed{x}", "\\boxed{7"]
    ids, mask = pad_right(encode(qwen_tokenizer, texts))
    nan = float("nan")
    targets = [
        ["72", "-3.5", "0.1", "1000.25", "0", "7"],
        ["72.0000001", "-3.4", "0.10000000000000001", "1000.2", nan, "x"],  # near misses, NaN, no number
        torch.tensor([72.0] * 6, dtype=torch.float64),
        torch.tensor([-3.5]),  # one value for the batch (an expanded view)
        72,  # a scalar
    ]
    for tolerance in ({}, {"abs_tol": 0.06}, {"rel_tol": 1e-4}, {"abs_tol": 1e-12, "rel_tol": 0.0}):
        compiled, torch_ops = twins(qwen_tokenizer, **tolerance)
        for target in targets:
            got = compiled.score(ids, mask, answer=target)
            assert got.dtype == torch.float32 and got.shape == (6,)
            assert torch.equal(got, torch_ops.score(ids, mask, answer=target)), (tolerance, target)
    for tolerance in ({"abs_tol": 0.06}, {"rel_tol": 1e-4}):  # 1000.2 is within 0.06, and within 1e-4 of itself
        compiled = MathAnswerReward(qwen_tokenizer, **tolerance)
        assert compiled.score(ids, mask, answer=targets[1]).tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]


def test_window_and_depth_limits_match(qwen_tokenizer, needs_compiler):
    texts = ["\\boxed{" + "{" * 15 + "8" + "}" * 16, "\\boxed{" + "{" * 16 + "9" + "}" * 17, "\\boxed{1 2 3 4 5 6 7}"]
    ids, mask = pad_right(encode(qwen_tokenizer, texts))
    for window in (1, 3, 24, 256):
        assert_same_extract(*twins(qwen_tokenizer, max_answer_tokens=window), ids, mask)
    # Qwen2.5 writes runs of braces as one token: the second box closes in a token entered below depth 16, so it is read
    value, found = MathAnswerReward(qwen_tokenizer).extract(ids, mask)
    assert value.tolist() == [8.0, 9.0, 0.0] and found.tolist() == [True, True, False] == [
        final_answer(t) is not None for t in texts
    ]


def test_score_through_the_kernel_traces_in_one_graph(qwen_tokenizer, needs_compiler):
    from tests.test_rewards_math import assert_vectorised

    reward = MathAnswerReward(qwen_tokenizer)
    assert reward.kernel is not None  # the default on CPU where it builds
    ids, mask = pad_right(encode(qwen_tokenizer, ["\\boxed{72}", "\\boxed{7}", "72"]))
    target = torch.tensor([72.0, 72.0, 72.0], dtype=torch.float64)
    assert assert_vectorised(reward.score, ids, mask, answer=target).tolist() == [1.0, 0.0, 0.0]


def test_kernel_from_several_threads_at_once(qwen_tokenizer, needs_compiler):
    compiled, torch_ops = twins(qwen_tokenizer)
    ids, mask, _ = make_batch(qwen_tokenizer, 32, 256, seed=5)
    want = torch_ops.extract(ids, mask)
    results, errors = [], []

    def work():
        try:
            for _ in range(20):
                results.append(compiled.extract(ids, mask))
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(results) == 80
    assert all(torch.equal(v, want[0]) and torch.equal(f, want[1]) for v, f in results)


def test_built_once_then_loaded_from_the_cache(qwen_tokenizer, needs_compiler, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_ASYNC_CACHE", str(tmp_path))
    native.library()
    built = list((tmp_path / "native").glob("last_box-*.so"))
    assert len(built) == 1 and built[0] == native.library_path(native.compiler())
    assert not list((tmp_path / "native").glob("*.tmp"))  # the partial file was renamed into place
    stamp = built[0].stat().st_mtime_ns
    native.reset()
    assert MathAnswerReward(qwen_tokenizer, cpu_kernel=True).kernel is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_without_a_compiler_the_torch_path_runs_or_a_clear_error(qwen_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_ASYNC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    reward = MathAnswerReward(qwen_tokenizer)  # the default falls back
    assert reward.kernel is None
    ids, mask = pad_right(encode(qwen_tokenizer, ["\\boxed{72}", "\\boxed{7}"]))
    assert reward.score(ids, mask, answer=["72", "72"]).tolist() == [1.0, 0.0]
    with pytest.raises(native.NativeUnavailable, match=r"cpu_kernel=True, but no C compiler: `no-such-cc`.*\$CC"):
        MathAnswerReward(qwen_tokenizer, cpu_kernel=True)


def test_a_compiler_command_with_flags_and_an_unloadable_cached_library(
    qwen_tokenizer, needs_compiler, tmp_path, monkeypatch
):
    monkeypatch.setenv("TRL_ASYNC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "cc -O1 -Wall")  # $CC may carry flags: they are part of the command and of the name
    assert native.compiler()[1:] == ["-O1", "-Wall"]
    path = native.library_path(native.compiler())
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")  # e.g. built on a machine with another C library
    assert MathAnswerReward(qwen_tokenizer).kernel is None  # falls back
    native.reset()
    with pytest.raises(native.NativeUnavailable, match="Cannot load .*delete it to rebuild"):
        native.library()
    path.unlink()
    native.reset()
    assert MathAnswerReward(qwen_tokenizer, cpu_kernel=True).kernel is not None  # rebuilt with the flags
    assert path.stat().st_size > 1000
    native.reset()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TRL_ASYNC_CACHE", str(tmp_path / "file"))  # no cache folder can be made there
    with pytest.raises(native.NativeUnavailable, match=r"Cannot create .*set \$TRL_ASYNC_CACHE"):
        native.library()


def test_a_failing_build_and_the_switches(qwen_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_ASYNC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    with pytest.raises(native.NativeUnavailable, match="false -O2 .*last_box.c.* failed"):
        MathAnswerReward(qwen_tokenizer, cpu_kernel=True)
    assert not list((tmp_path / "native").glob("*"))  # nothing half-built left behind
    monkeypatch.delenv("CC")
    native.reset()
    if native.compiler() is not None:
        native.library()  # built and loaded: the switch still turns it off for every reward made after it
    monkeypatch.setenv("TRL_ASYNC_NATIVE", "0")
    assert MathAnswerReward(qwen_tokenizer).kernel is None
    with pytest.raises(native.NativeUnavailable, match="TRL_ASYNC_NATIVE=0"):
        MathAnswerReward(qwen_tokenizer, cpu_kernel=True)


def test_formats_and_windows_the_kernel_does_not_cover(qwen_tokenizer, needs_compiler):
    assert MathAnswerReward(qwen_tokenizer, answer_format="hash").kernel is None
    assert MathAnswerReward(qwen_tokenizer, max_answer_tokens=300).kernel is None  # torch ops read it
    with pytest.raises(native.NativeUnavailable, match="hash"):
        MathAnswerReward(qwen_tokenizer, answer_format="hash", cpu_kernel=True)
    with pytest.raises(native.NativeUnavailable, match="at most 256 tokens; got 300"):
        MathAnswerReward(qwen_tokenizer, max_answer_tokens=300, cpu_kernel=True)


def test_a_reward_with_the_kernel_pickles_and_deep_copies(qwen_tokenizer, needs_compiler, monkeypatch):
    """A reward sent to another process (or copied with its config) rebuilds its kernel there."""
    reward = MathAnswerReward(qwen_tokenizer)
    ids, mask = pad_right(encode(qwen_tokenizer, ["\\boxed{72}", "\\boxed{7}"]))
    for clone in (pickle.loads(pickle.dumps(reward)), copy.deepcopy(reward)):
        assert clone.kernel is not None and clone.kernel is not reward.kernel
        assert clone.score(ids, mask, answer=["72", "72"]).tolist() == [1.0, 0.0]
    payload = pickle.dumps(reward)
    native.reset()
    monkeypatch.setenv("CC", "no-such-cc")  # unpickled where no compiler exists: the torch-op path
    clone = pickle.loads(payload)
    assert clone.kernel is None and clone.score(ids, mask, answer=["72", "72"]).tolist() == [1.0, 0.0]
    monkeypatch.delenv("CC")
    native.reset()
    required = pickle.dumps(MathAnswerReward(qwen_tokenizer, cpu_kernel=True))
    native.reset()
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(native.NativeUnavailable, match="cpu_kernel=True, but no C compiler"):
        pickle.loads(required)  # cpu_kernel=True means the kernel or an error, in every process


def test_a_traced_graph_whose_kernel_is_gone_says_so(qwen_tokenizer, needs_compiler):
    ids, mask = pad_right(encode(qwen_tokenizer, ["\\boxed{72}"]))
    with pytest.raises(RuntimeError, match="kernel 123456789 is gone from this process"):
        torch.ops.trl_async.last_box(ids, mask, 123456789, None, 0.0, 0.0)
