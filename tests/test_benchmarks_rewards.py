"""The reward benchmark runs end to end on a small cell and prints its table (speed itself is not asserted)."""

import torch

from trl_async.benchmarks import rewards as bench
from trl_async.rewards import native


def test_reward_benchmark_prints_its_table(capsys):
    bench.main(["--batches", "8", "--lengths", "96", "--repeats", "1", "--threads", "1", "--cpu-only"])
    out = capsys.readouterr().out
    first, second = out.split("Against the seed loop")
    rows = [line.split("|")[4:-1] for line in first.splitlines() if line.startswith("| 8 | 96 | cpu |")]
    methods = [row[0].strip() for row in rows]  # method, samples/s, speed-up
    torch_ops = ["tensor, torch ops"] if native.compiler() is not None else []  # the default is torch ops then
    assert methods == ["tensor", *torch_ops, "decode+regex", "seed loop", "math-verify"]
    against_loop = [line.split("|")[4:-1] for line in second.splitlines() if line.startswith("| 8 | 96 | cpu |")]
    assert [row[0].strip() for row in against_loop] == ["tensor", *torch_ops, "seed rule"]
    assert all(row[2].strip().endswith("x") for row in against_loop)
    assert "command: python -m trl_async.benchmarks.rewards" in out


def test_methods_take_turns_in_a_rotating_order():
    calls = []
    methods = {name: (lambda name=name: calls.append(name)) for name in "ABC"}
    seconds = bench.timed_side_by_side(methods, repeats=3, device=torch.device("cpu"))
    assert set(seconds) == {"A", "B", "C"}
    assert calls == list("ABC") + list("ABC") + list("BCA") + list("CAB")  # warm-up, then rotating turns
