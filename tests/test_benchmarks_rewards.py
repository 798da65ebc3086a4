"""The reward benchmark runs end to end on a small cell and prints its table (speed itself is not asserted)."""

import torch

from trl_async.benchmarks import rewards as bench


def test_reward_benchmark_prints_its_table(capsys):
    bench.main(["--batches", "8", "--lengths", "96", "--repeats", "1", "--threads", "1", "--cpu-only"])
    out = capsys.readouterr().out
    rows = [line.split("|")[4:-1] for line in out.splitlines() if line.startswith("| 8 | 96 | cpu |")]
    methods = [row[0].strip() for row in rows if len(row) == 3]  # method, samples/s, speed-up
    assert methods == ["tensor", "decode+regex", "seed loop", "math-verify"]
    seed_rule = [row for row in rows if len(row) == 2]  # samples/s, speed-up over the seed loop
    assert "faster than the seed loop by" in out and len(seed_rule) == 1 and seed_rule[0][1].strip().endswith("x")
    assert "command: python -m trl_async.benchmarks.rewards" in out


def test_methods_take_turns_in_a_rotating_order():
    calls = []
    methods = {name: (lambda name=name: calls.append(name)) for name in "ABC"}
    seconds = bench.timed_side_by_side(methods, repeats=3, device=torch.device("cpu"))
    assert set(seconds) == {"A", "B", "C"}
    assert calls == list("ABC") + list("ABC") + list("BCA") + list("CAB")  # warm-up, then rotating turns
