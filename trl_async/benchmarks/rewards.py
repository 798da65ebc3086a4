"""Throughput of the tensor math reward against the ways people score GSM8K completions today.

    python -m trl_async.benchmarks.rewards              # B in {64, 256, 1024} x L in {256, 512}, CPU (+ GPU if any)
    python -m trl_async.benchmarks.rewards --quick      # B=256, L=512 only

Methods, all scoring the same batch of right-padded completion ids (Qwen2.5 tokenizer, EOS-terminated, some cut
off) against a string ``answer`` column, and all returning a ``(B,)`` reward tensor on the batch's device:

* ``tensor``: ``MathAnswerReward.score(ids, mask, answer=[...])`` (last ``\\boxed{}``, parsed on the tensor), as
  it runs by default: on a CPU through its compiled kernel (:mod:`trl_async.rewards.native`) where one can be built.
* ``tensor, torch ops``: the same reward with ``cpu_kernel=False``, the torch-op path every other device runs (shown on
  CPU when the default is the kernel).
* ``decode+regex``: ``ids.tolist()``, ``tokenizer.batch_decode`` of each row up to its length, then the reward's
  own string specification (:func:`trl_async.rewards.final_answer`, regex based) per text.
* ``math-verify``: the same decode, then ``math_verify.parse`` + ``verify`` per text. It is slow, so above 64 samples
  it is timed on the first 64 and scaled per sample (marked ``*``).
* ``seed loop``: the seed page's Algorithm 1, reimplemented faithfully as a baseline: a Python loop over the batch
  with ``first_eos[b].item()`` and ``Y[b, :valid_len].unfold(0, K, 1)`` against the answer's token ids (tokenised
  before timing). It pays when those tokens appear *anywhere*, so it is not the same reward; it is here for speed.
* ``seed rule``: that same rule as tensor ops, ``TokenPatternReward(anchor="anywhere")`` on the same ids, checked
  equal to the seed loop's rewards: the like-for-like comparison with the loop (second table).

Each cell is the median of ``--repeats`` timed runs after one warm-up, the methods taking turns in a rotating order
(so a slow spell of the machine, or the cold caches one method leaves behind, hit all of them alike); samples/s = B /
median seconds. Threads:
``--threads 2`` by default; on a 2-core machine that is busy with anything else, two OpenMP threads make every tensor
op wait for a descheduled thread (erratic, up to 10x slower), so measure there with ``--threads 1``.

Where the time goes (CPU, B=256, L=512): the default score is ~0.16 ms back to back at 1 thread (one C call that
scans the ids, skipping the tokens that cannot touch ``\\boxed{`` or EOS with a bitmap, then reads and compares the
box; plus the target column), ~0.4-0.5 ms timed in turns with the other methods, as this benchmark does (the caches and
predictors other code leaves behind, as in a trainer, where the reward runs between generation and the loss). The
torch-op path is ~150 small ops (~0.6 ms the one pass over the ``(B, L)`` ids, ~0.45 ms the box over 24 tokens, at 1
thread), so on a CPU it costs mostly dispatch; ``torch.compile`` (inductor, CPU) made its ``(B, L)`` pass 1.5x slower
here, not faster. The seed loop costs ~22 us a sample.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time

import torch

from trl_async.rewards import MathAnswerReward, TokenPatternReward, final_answer, target_value

MATH_VERIFY_SUBSET = 64
TORCH_OPS = "tensor, torch ops"


def make_batch(tokenizer, batch: int, length: int, seed: int = 0):
    """``batch`` completions of up to ``length`` tokens: reasoning, then a boxed answer (right, wrong or cut off)."""
    rng = random.Random(seed)
    rows, answers = [], []
    for _ in range(batch):
        value = rng.choice([rng.randint(0, 500), rng.randint(1000, 99999), round(rng.uniform(0, 100), 2)])
        shown = f"{value:,}" if rng.random() < 0.5 else str(value)
        boxed = shown if rng.random() < 0.5 else str(value + 1)
        steps = []
        while len(steps) * 14 < length:
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            steps.append(f"Next, {a} * {b} = {a * b}, so we carry {a + b} forward.")
        final = f" Therefore, the final answer is $\\boxed{{{boxed}}}$."
        ids = tokenizer(" ".join(steps), add_special_tokens=False).input_ids
        tail = tokenizer(final, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        keep = rng.randint(length // 2, length)  # completions of different lengths; a few are cut off
        row = (ids[: max(0, keep - len(tail))] + tail)[:keep] if rng.random() < 0.9 else ids[:keep]
        rows.append(row)
        answers.append(rng.choice([shown, f"We add them up.\n#### {value}"]))
    ids = torch.full((batch, length), tokenizer.pad_token_id, dtype=torch.long)  # (B, L)
    mask = torch.zeros((batch, length), dtype=torch.bool)  # (B, L)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
        mask[b, : len(row)] = True
    return ids, mask, answers


def decode(tokenizer, ids, mask):
    lengths = mask.sum(dim=1).tolist()
    return tokenizer.batch_decode([row[:n] for row, n in zip(ids.tolist(), lengths)], skip_special_tokens=True)


def decode_regex(tokenizer, ids, mask, answers):
    texts = decode(tokenizer, ids, mask)
    values = [final_answer(t) for t in texts]
    rewards = [float(v is not None and v == target_value(a)) for v, a in zip(values, answers)]
    return torch.tensor(rewards, device=ids.device)


def math_verify_reward(tokenizer, ids, mask, answers):
    from math_verify import parse, verify

    texts = decode(tokenizer, ids, mask)
    rewards = []
    for text, answer in zip(texts, answers):
        gold = parse(str(target_value(answer)), parsing_timeout=None)
        rewards.append(float(verify(gold, parse(text, parsing_timeout=None), timeout_seconds=None)))
    return torch.tensor(rewards, device=ids.device)


def seed_loop(ids, eos_token_id, patterns):
    """The seed page's Algorithm 1, as written there (a baseline: a Python loop with a host sync per sample)."""
    batch, length = ids.shape
    rewards = torch.zeros(batch, dtype=torch.float32, device=ids.device)
    eos_mask = ids == eos_token_id
    has_eos = eos_mask.any(dim=-1)
    first_eos = torch.where(has_eos, eos_mask.int().argmax(dim=-1), length)
    for b in range(batch):
        valid_len = first_eos[b].item()
        target_pattern = patterns[b]
        k = len(target_pattern)
        if k == 0 or k > valid_len:
            continue
        windows = ids[b, :valid_len].unfold(dimension=0, size=k, step=1)
        match = (windows == target_pattern).all(dim=-1).any()
        rewards[b] = 1.0 if match else 0.0
    return rewards


def timed_side_by_side(methods: dict, repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each method, timed in turns after one warm-up each, so that a slow spell of a noisy machine
    hits every method alike. The order rotates every repeat (A B C, B C A, C A B, ...): each method runs as often
    right after every other one, so none always inherits the caches another one left cold."""
    for fn in methods.values():
        fn()
    names = list(methods)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for repeat in range(repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            fn = methods[name]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def pattern_tensor(patterns: list[torch.Tensor]) -> torch.Tensor:
    """Per-sample id lists -> ``(B, K)`` long tensor padded with -1."""
    out = torch.full((len(patterns), max(len(p) for p in patterns)), -1, dtype=torch.long)
    for b, p in enumerate(patterns):
        out[b, : len(p)] = p
    return out


def time_cell(tokenizer, rewards, ids_cpu, mask_cpu, answers, patterns_cpu, repeats, device) -> dict[str, float]:
    """Median seconds per batch of each method on one (B, L, device) cell. ``rewards``: the default
    ``MathAnswerReward`` and its torch-ops twin (``cpu_kernel=False``)."""
    reward, torch_ops = rewards
    ids, mask = ids_cpu.to(device), mask_cpu.to(device)
    patterns = [p.to(device) for p in patterns_cpu]
    expected = decode_regex(tokenizer, ids_cpu, mask_cpu, answers)
    assert torch.equal(reward.score(ids, mask, answer=answers).cpu(), expected), "tensor path != string spec"
    assert torch.equal(torch_ops.score(ids, mask, answer=answers).cpu(), expected), "torch ops != string spec"
    seed_rule = TokenPatternReward(tokenizer, anchor="anywhere")
    pattern = pattern_tensor(patterns_cpu).to(device)  # (B, K)
    seed_rewards = seed_loop(ids, tokenizer.eos_token_id, patterns)
    assert torch.equal(seed_rule.score(ids, mask, answer=pattern), seed_rewards), "seed rule != seed loop"
    batch = ids.shape[0]
    subset = min(batch, MATH_VERIFY_SUBSET)
    math_verify = "math-verify" + ("*" if subset < batch else "")
    methods = {
        "tensor": lambda: reward.score(ids, mask, answer=answers),
        TORCH_OPS: lambda: torch_ops.score(ids, mask, answer=answers),
        "decode+regex": lambda: decode_regex(tokenizer, ids, mask, answers),
        "seed loop": lambda: seed_loop(ids, tokenizer.eos_token_id, patterns),
        "seed rule": lambda: seed_rule.score(ids, mask, answer=pattern),
        math_verify: lambda: math_verify_reward(tokenizer, ids[:subset], mask[:subset], answers[:subset]),
    }
    if device.type != "cpu" or reward.kernel is None:  # then "tensor" already is the torch-op path
        del methods[TORCH_OPS]
    seconds = timed_side_by_side(methods, repeats, device)
    seconds[math_verify] *= batch / subset
    return seconds


def run(batches, lengths, repeats: int, devices) -> list[dict]:
    from trl_async.offline_assets import qwen2_tokenizer

    tokenizer = qwen2_tokenizer()
    rewards = MathAnswerReward(tokenizer), MathAnswerReward(tokenizer, cpu_kernel=False)
    rows = []
    for length in lengths:
        for batch in batches:
            ids_cpu, mask_cpu, answers = make_batch(tokenizer, batch, length)
            patterns_cpu = [
                torch.tensor(tokenizer(str(target_value(a)).removesuffix(".0"), add_special_tokens=False).input_ids)
                for a in answers
            ]
            for device in devices:
                seconds = time_cell(tokenizer, rewards, ids_cpu, mask_cpu, answers, patterns_cpu, repeats, device)
                tensor_s = seconds["tensor"]
                for name, s in seconds.items():
                    rows.append(dict(B=batch, L=length, device=str(device), method=name, per_s=batch / s, s=s))
                    rows[-1]["speedup"] = s / tensor_s
                print(f"done B={batch} L={length} {device}", file=sys.stderr, flush=True)
    return rows


def markdown(rows) -> str:
    """The methods against the tensor math reward, then the tensor paths and the seed's rule as tensor ops against
    the seed's loop."""
    lines = [
        "| B | L | device | method | samples/s (median) | tensor is faster by |",
        "|---:|---:|---|---|---:|---:|",
    ]
    for r in rows:
        if r["method"] == "seed rule":
            continue
        speedup = "—" if r["method"] == "tensor" else f"{r['speedup']:,.1f}x"
        lines.append(f"| {r['B']} | {r['L']} | {r['device']} | {r['method']} | {r['per_s']:,.0f} | {speedup} |")
    lines += [
        "",
        "Against the seed loop; `seed rule` is its rule (the answer's tokens anywhere before EOS) as tensor ops,",
        '`TokenPatternReward(anchor="anywhere")`, checked equal to the loop\'s rewards:',
        "",
        "| B | L | device | method | samples/s (median) | faster than the seed loop by |",
        "|---:|---:|---|---|---:|---:|",
    ]
    cells = {(r["B"], r["L"], r["device"], r["method"]): r for r in rows}
    for r in rows:
        if r["method"] in ("tensor", TORCH_OPS, "seed rule"):
            loop = cells[(r["B"], r["L"], r["device"], "seed loop")]
            lines.append(
                f"| {r['B']} | {r['L']} | {r['device']} | {r['method']} | {r['per_s']:,.0f} | "
                f"{loop['s'] / r['s']:,.1f}x |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B=256, L=512 only")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default: 64 256 1024)")
    parser.add_argument("--lengths", type=int, nargs="+", help="completion lengths (default: 256 512)")
    parser.add_argument("--repeats", type=int, default=8, help="timed runs per cell (median reported; >= 5)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--cpu-only", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    batches, lengths = ([256], [512]) if args.quick else ([64, 256, 1024], [256, 512])
    batches, lengths = args.batches or batches, args.lengths or lengths
    devices = [torch.device("cpu")]
    if torch.cuda.is_available() and not args.cpu_only:
        devices.append(torch.device("cuda"))
    rows = run(batches, lengths, args.repeats, devices)
    print(f"command: python -m trl_async.benchmarks.rewards {' '.join(argv or sys.argv[1:])}".rstrip())
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() and not args.cpu_only else ""
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads){gpu}, python {platform.python_version()}; "
        f"median of {args.repeats} runs, methods timed in turns"
    )
    print("* math-verify timed on the first 64 samples and scaled per sample.\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
