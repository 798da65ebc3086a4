"""Staleness study: what M2PO and the other off-policy corrections buy when rollouts are stale.

    python -m trl_async.benchmarks.staleness            # full run (~15-25 min on 2 CPU cores)
    python -m trl_async.benchmarks.staleness --quick    # all three tables in a few minutes

Method (printed with the tables, so every number carries its recipe):

* Model and task: a tiny random Qwen2 (``transformers.Qwen2ForCausalLM``, 2 layers, hidden 64, vocabulary of 16
  content tokens + BOS, ~75k parameters) learns a toy task with a dense reward: the prompt is BOS + 3 random tokens,
  the completion is 8 sampled tokens (temperature 1), and the reward is the fraction of completion tokens that are
  the successor ``(previous token + 1) mod 16`` of the token before them. A random policy scores 1/16; on-policy
  GRPO reaches ~0.99 in ~200 steps (~20 s). It is a small model on a toy task, not an LLM, and its policy moves
  much more per step than an LLM's at lr 1e-6: the numbers compare corrections on equal terms, nothing more.
* GRPO data: 8 prompts x 8 completions per step, group-normalised advantages, Adam (lr 1e-3). Every loss is aggregated with
  TRL's default ``loss_type="dapo"`` normaliser (token mean over the batch) through ``trl_async.m2po.aggregate_loss``.
* Forced staleness ``tau``: at optimizer step ``k`` the batch is sampled from the snapshot of step ``max(0, k - tau)``
  (a ring of the last ``tau + 1`` snapshots). Behaviour log-probs are that snapshot's; the proximal log-probs are
  the current policy's without gradient (one optimizer step per batch, as TRL with default settings).
* Losses (the same per-token formulas as the trainer): PPO-clip = TRL's clipped surrogate with the ratio against the
  behaviour log-probs (``off_policy_correction="none"``); TIS = TRL's ``token_truncate`` correction
  (``clamp(exp(proximal - behaviour), max=3)`` times the clipped surrogate against the proximal policy); M2PO =
  ``second_moment_mask`` on proximal - behaviour (tau = 0.04) and ``-(M * exp(log_ratio) * A)``, no clip;
  token variant = the seed page's ``r**2 <= 2`` rule inside PPO clipping.

Tables: (1) gradient norm (mean and std over many batches, and the trace of the gradient covariance) vs staleness, at
the end of a short on-policy run, with behaviour = the snapshot ``tau`` steps older; (2) final reward of training
runs under forced staleness; (3) wall time of the M2PO loss vs the GRPO loss on the same tensors.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trl_async.m2po import aggregate_loss, m2po_per_token_loss, second_moment_mask, token_variant_per_token_loss

NUM_CONTENT = 16  # token ids 0..15 are content, 16 is BOS
BOS = NUM_CONTENT
PROMPT_LEN = 4  # BOS + 3 content tokens
COMPLETION_LEN = 8
EPSILON = 0.2  # PPO clip (TRL's default epsilon)
TIS_CLIP_MAX = 3.0  # TRL's default vllm_importance_sampling_clip_max
M2_THRESHOLD = 0.04  # the paper's tau
SEED_GAMMA = 2.0  # the seed page's gamma
CORRECTIONS = ("ppo_clip", "tis", "m2po", "token")
LABELS = {"ppo_clip": "PPO-clip (none)", "tis": "TIS", "m2po": "M2PO", "token": "token variant (seed)"}
COLORS = {"ppo_clip": "tab:blue", "tis": "tab:orange", "m2po": "tab:green", "token": "tab:red"}


@dataclass
class Settings:
    quick: bool
    prompts_per_step: int = 8
    generations: int = 8
    learning_rate: float = 1e-3
    # (1) gradient variance
    variance_train_steps: int = 50
    variance_batches: int = 64
    variance_taus: tuple[int, ...] = (0, 1, 2, 3, 5, 8)
    # (2) learning under staleness
    train_steps: int = 300
    staleness: tuple[int, ...] = (0, 4, 16, 64)
    learning_corrections: tuple[str, ...] = ("ppo_clip", "tis", "m2po")
    seeds: tuple[int, ...] = (0, 1, 2)
    eval_every: int = 25
    eval_sequences: int = 512
    # (3) loss cost
    cost_shapes: tuple[tuple[int, int], ...] = ((64, 256), (256, 1024), (512, 2048))
    cost_min_run_s: float = 1.0

    @classmethod
    def make(cls, quick: bool) -> Settings:
        if not quick:
            return cls(quick=False)
        return cls(
            quick=True,
            variance_batches=24,
            train_steps=200,
            seeds=(0,),
            eval_every=50,
            eval_sequences=256,
            cost_shapes=((64, 256), (256, 1024)),
            cost_min_run_s=0.3,
        )


# ---- the toy task --------------------------------------------------------------------------------------------------


def make_policy(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=NUM_CONTENT + 1,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).train()


def sample_prompts(num_prompts: int, generations: int, generator: torch.Generator) -> torch.Tensor:
    content = torch.randint(0, NUM_CONTENT, (num_prompts, PROMPT_LEN - 1), generator=generator)
    prompts = torch.cat([torch.full((num_prompts, 1), BOS), content], dim=1)  # (P, 4)
    return prompts.repeat_interleave(generations, dim=0)  # (P*G, 4) prompt-major groups


@torch.no_grad()
def sample_completions(policy, prompts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    sequences = prompts
    for _ in range(COMPLETION_LEN):
        logits = policy(sequences).logits[:, -1, :NUM_CONTENT]  # (N, 16): BOS is never sampled
        probs = torch.softmax(logits.float(), dim=-1)
        next_token = torch.multinomial(probs, 1, generator=generator)  # (N, 1)
        sequences = torch.cat([sequences, next_token], dim=1)
    return sequences  # (N, 4 + 8)


def completion_logps(policy, sequences: torch.Tensor) -> torch.Tensor:
    logits = policy(sequences).logits[:, PROMPT_LEN - 1 : -1, :NUM_CONTENT].float()  # (N, 8, 16)
    return torch.log_softmax(logits, -1).gather(-1, sequences[:, PROMPT_LEN:, None]).squeeze(-1)  # (N, 8)


def rewards_of(sequences: torch.Tensor) -> torch.Tensor:
    previous, completion = sequences[:, PROMPT_LEN - 1 : -1], sequences[:, PROMPT_LEN:]  # (N, 8) each
    return (completion == (previous + 1) % NUM_CONTENT).float().mean(-1)  # (N,) dense: share of successors


def group_advantages(rewards: torch.Tensor, generations: int) -> torch.Tensor:
    grouped = rewards.view(-1, generations)  # (P, G)
    advantages = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-4)
    return advantages.view(-1)  # (N,)


# ---- the losses (same per-token formulas as the trainer; dapo token-mean normaliser) ------------------------------


def correction_loss(name: str, logps, proximal, behaviour, advantages) -> tuple[torch.Tensor, float]:
    """``(loss, masked_fraction)`` for one batch. ``logps`` (N, T) carries the gradient; ``proximal``/``behaviour``
    do not. ``masked_fraction``: share of tokens the M2PO / token-variant rule drops (0 for the others)."""
    valid = torch.ones_like(logps, dtype=torch.bool)  # fixed-length completions: no padding
    A = advantages[:, None]  # (N, 1)
    if name == "ppo_clip":  # TRL's loss, old_per_token_logps = behaviour
        ratio = torch.exp(logps - behaviour)
        per_token = -torch.min(ratio * A, ratio.clamp(1 - EPSILON, 1 + EPSILON) * A)
        mask = valid
    elif name == "tis":  # TRL's loss against the proximal policy, times its token_truncate IS weight
        ratio = torch.exp(logps - proximal)
        is_weight = torch.exp(proximal - behaviour).clamp(max=TIS_CLIP_MAX)
        per_token = -torch.min(ratio * A, ratio.clamp(1 - EPSILON, 1 + EPSILON) * A) * is_weight
        mask = valid
    elif name == "m2po":
        keep = second_moment_mask(proximal - behaviour, valid, M2_THRESHOLD)
        per_token = m2po_per_token_loss(logps - behaviour, advantages, keep)
        mask = valid
    elif name == "token":
        per_token, keep, _ = token_variant_per_token_loss(
            logps - behaviour, advantages, valid, SEED_GAMMA, EPSILON, EPSILON
        )
        mask = keep  # the seed's 1/Z_m
    else:
        raise ValueError(name)
    loss, _ = aggregate_loss(per_token, mask, "dapo", num_items_in_batch=mask.sum())
    masked = 1 - keep.float().mean().item() if name in ("m2po", "token") else 0.0
    return loss, masked


# ---- (1) gradient variance vs staleness ----------------------------------------------------------------------------


def train_snapshots(settings: Settings, seed: int) -> list[dict]:
    """A short on-policy GRPO run; returns the state dict after every optimizer step (index = policy version)."""
    policy = make_policy(seed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=settings.learning_rate)
    generator = torch.Generator().manual_seed(1000 + seed)
    snapshots = [copy.deepcopy(policy.state_dict())]
    for _ in range(settings.variance_train_steps):
        prompts = sample_prompts(settings.prompts_per_step, settings.generations, generator)
        sequences = sample_completions(policy, prompts, generator)
        advantages = group_advantages(rewards_of(sequences), settings.generations)
        logps = completion_logps(policy, sequences)
        loss, _ = correction_loss("ppo_clip", logps, logps.detach(), logps.detach(), advantages)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        snapshots.append(copy.deepcopy(policy.state_dict()))
    return snapshots


def gradient_variance(settings: Settings, seed: int = 0) -> list[dict]:
    snapshots = train_snapshots(settings, seed)
    current, behaviour_policy = make_policy(seed), make_policy(seed)
    current.load_state_dict(snapshots[-1])
    params = [p for p in current.parameters() if p.requires_grad]
    rows = []
    for tau in settings.variance_taus:
        behaviour_policy.load_state_dict(snapshots[-1 - tau])
        generator = torch.Generator().manual_seed(2000 + tau)
        grads = {name: [] for name in CORRECTIONS}
        masked = []
        for _ in range(settings.variance_batches):
            prompts = sample_prompts(settings.prompts_per_step, settings.generations, generator)
            sequences = sample_completions(behaviour_policy, prompts, generator)
            advantages = group_advantages(rewards_of(sequences), settings.generations)
            with torch.no_grad():
                behaviour = completion_logps(behaviour_policy, sequences)
            logps = completion_logps(current, sequences)
            proximal = logps.detach()
            for name in CORRECTIONS:
                loss, masked_fraction = correction_loss(name, logps, proximal, behaviour, advantages)
                if name == "m2po":
                    masked.append(masked_fraction)
                flat = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)])
                grads[name].append(flat)
        row = {"tau": tau, "m2po_masked_fraction": sum(masked) / len(masked)}
        for name in CORRECTIONS:
            stacked = torch.stack(grads[name])  # (batches, num_params)
            norms = stacked.norm(dim=1)
            row[f"{name}_norm_mean"] = norms.mean().item()
            row[f"{name}_norm_std"] = norms.std().item()
            row[f"{name}_trace_cov"] = (stacked - stacked.mean(0)).square().sum(1).mean().item()
        rows.append(row)
    return rows


# ---- (2) learning under forced staleness ---------------------------------------------------------------------------


@torch.no_grad()
def evaluate(policy, num_sequences: int, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    prompts = sample_prompts(num_sequences, 1, generator)
    return rewards_of(sample_completions(policy, prompts, generator)).mean().item()


def train_stale(settings: Settings, correction: str, tau: int, seed: int) -> dict:
    policy, behaviour_policy = make_policy(seed), make_policy(seed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=settings.learning_rate)
    generator = torch.Generator().manual_seed(3000 + seed)
    ring = collections.deque([copy.deepcopy(policy.state_dict())], maxlen=tau + 1)  # ring[0] = version k - tau
    curve, finite, masked = [(0, evaluate(policy, settings.eval_sequences, 10_000 + seed))], True, []
    for step in range(1, settings.train_steps + 1):
        behaviour_policy.load_state_dict(ring[0])
        prompts = sample_prompts(settings.prompts_per_step, settings.generations, generator)
        sequences = sample_completions(behaviour_policy, prompts, generator)
        advantages = group_advantages(rewards_of(sequences), settings.generations)
        with torch.no_grad():
            behaviour = completion_logps(behaviour_policy, sequences)
        logps = completion_logps(policy, sequences)
        loss, masked_fraction = correction_loss(correction, logps, logps.detach(), behaviour, advantages)
        masked.append(masked_fraction)
        if not torch.isfinite(loss):
            finite = False
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ring.append(copy.deepcopy(policy.state_dict()))
        if step % settings.eval_every == 0 or step == settings.train_steps:
            curve.append((step, evaluate(policy, settings.eval_sequences, 10_000 + seed + step)))
    final = curve[-1][1] if finite else float("nan")
    peak = max(r for _, r in curve)
    collapsed = (not finite) or final < 0.5 * peak
    return {"correction": correction, "tau": tau, "seed": seed, "final": final, "peak": peak,
            "collapsed": collapsed, "masked_mean": sum(masked) / max(len(masked), 1), "curve": curve}  # fmt: skip


def learning_under_staleness(settings: Settings) -> list[dict]:
    runs = []
    for tau in settings.staleness:
        for correction in settings.learning_corrections:
            if tau == 0 and correction != settings.learning_corrections[0]:
                continue  # at tau = 0 every correction is the same on-policy loss
            for seed in settings.seeds:
                start = time.perf_counter()
                run = train_stale(settings, correction, tau, seed)
                run["seconds"] = time.perf_counter() - start
                print(f"  learning: tau={tau:<3} {correction:<8} seed={seed} final={run['final']:.3f} "
                      f"({run['seconds']:.0f} s)", flush=True)  # fmt: skip
                runs.append(run)
    return runs


# ---- (3) loss cost -------------------------------------------------------------------------------------------------


def loss_cost(settings: Settings) -> list[dict]:
    return [_loss_cost_of_shape(batch, length, settings.cost_min_run_s) for batch, length in settings.cost_shapes]


def _loss_cost_of_shape(batch: int, length: int, min_run_s: float) -> dict:
    from torch.utils.benchmark import Timer

    generator = torch.Generator().manual_seed(batch * length)
    logps = (-torch.rand(batch, length, generator=generator) * 3).requires_grad_(True)  # (B, L) current, with grad
    proximal = logps.detach() + 0.01 * torch.randn(batch, length, generator=generator)  # (B, L)
    # behaviour log-probs of a mildly and of a very stale batch: log_ratio std 0.1 (M2 ~ 0.01) and 0.3 (M2 ~ 0.09)
    behaviours = {std: proximal + std * torch.randn(batch, length, generator=generator) for std in (0.1, 0.3)}
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=generator)
    valid = torch.arange(length)[None, :] < lengths[:, None]  # (B, L)
    advantages = torch.randn(batch, generator=generator)  # (B,)
    behaviour = behaviours[0.3]
    keep = second_moment_mask(proximal - behaviour, valid, M2_THRESHOLD)
    num_items = valid.sum()

    def backward(per_token, mask, items):
        loss, _ = aggregate_loss(per_token, mask, "dapo", num_items_in_batch=items)
        loss.backward()
        logps.grad = None

    def grpo():  # TRL's clipped surrogate against old_per_token_logps
        ratio = torch.exp(logps - proximal)
        backward(
            -torch.min(ratio * advantages[:, None], ratio.clamp(0.8, 1.2) * advantages[:, None]), valid, num_items
        )

    def m2po_step():  # what the trainer runs per micro-batch: the mask was made once per generation batch
        backward(m2po_per_token_loss(logps - behaviour, advantages, keep), valid, num_items)

    def m2po_with_mask(std):  # mask included, as if it were recomputed for every micro-batch
        mask = second_moment_mask(proximal - behaviours[std], valid, M2_THRESHOLD)
        backward(m2po_per_token_loss(logps - behaviours[std], advantages, mask), valid, num_items)

    def token_variant():
        per_token, mask, _ = token_variant_per_token_loss(logps - behaviour, advantages, valid, 2.0, 0.2, 0.2)
        backward(per_token, mask, mask.sum())

    cases = {
        "grpo": grpo,
        "m2po_step": m2po_step,
        "m2po_mask_0.1": lambda: m2po_with_mask(0.1),
        "m2po_mask_0.3": lambda: m2po_with_mask(0.3),
        "token": token_variant,
    }
    row = {"B": batch, "L": length}
    for name, fn in cases.items():
        fn()  # warm-up
        row[f"{name}_ms"] = Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_s).median * 1e3
    return row


# ---- report --------------------------------------------------------------------------------------------------------


def table_variance(rows: list[dict]) -> str:
    head = "| tau | " + " | ".join(f"{LABELS[c]} grad norm" for c in CORRECTIONS)
    head += " | norm cut, 1 - M2PO/PPO-clip | tr Cov, PPO-clip / M2PO | M2PO masked |"
    lines = [head, "|" + "---|" * (len(CORRECTIONS) + 4)]
    for r in rows:
        cells = [f"{r[f'{c}_norm_mean']:.4f} ± {r[f'{c}_norm_std']:.4f}" for c in CORRECTIONS]
        cut = 1 - r["m2po_norm_mean"] / r["ppo_clip_norm_mean"]
        cov = f"{r['ppo_clip_trace_cov']:.2e} / {r['m2po_trace_cov']:.2e}"
        lines.append(
            f"| {r['tau']} | " + " | ".join(cells) + f" | {cut:+.1%} | {cov} | {r['m2po_masked_fraction']:.2%} |"
        )
    return "\n".join(lines)


def table_learning(runs: list[dict], settings: Settings) -> str:
    on_policy = [r["final"] for r in runs if r["tau"] == 0]
    reference = sum(on_policy) / len(on_policy)
    half = settings.train_steps // 2  # evaluated: train_steps / 2 is a multiple of eval_every in both settings
    lines = [
        f"| staleness | correction | reward @ step {half} | final reward (mean ± std over seeds) | % of on-policy "
        "| collapsed | M2PO masked |",
        "|---|---|---|---|---|---|---|",
    ]
    for tau in settings.staleness:
        for correction in settings.learning_corrections:
            group = [r for r in runs if r["tau"] == tau and r["correction"] == correction]
            if not group:
                continue
            finals = torch.tensor([r["final"] for r in group])
            std = finals.std().item() if len(group) > 1 else 0.0
            name = "any (on-policy)" if tau == 0 else LABELS[correction]
            collapsed = sum(r["collapsed"] for r in group)
            masked = f"{sum(r['masked_mean'] for r in group) / len(group):.1%}" if correction == "m2po" else ""
            at_half = sum(dict(r["curve"]).get(half, float("nan")) for r in group) / len(group)
            lines.append(
                f"| {tau} | {name} | {at_half:.3f} | {finals.mean().item():.3f} ± {std:.3f} | "
                f"{finals.mean().item() / reference:.0%} | {collapsed}/{len(group)} | {masked} |"
            )
    return "\n".join(lines)


def table_cost(rows: list[dict]) -> str:
    lines = [
        "| B x L | GRPO loss | M2PO loss, mask given (per micro-batch) | M2PO loss + mask, log_ratio std 0.1 "
        "| M2PO loss + mask, std 0.3 | token variant |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        grpo = r["grpo_ms"]
        cells = [
            f"{r[k]:.3f} ms ({r[k] / grpo:.2f}x)" for k in ("m2po_step_ms", "m2po_mask_0.1_ms", "m2po_mask_0.3_ms")
        ]
        lines.append(
            f"| {r['B']} x {r['L']} | {grpo:.3f} ms | " + " | ".join(cells) + f" | {r['token_ms']:.3f} ms "
            f"({r['token_ms'] / grpo:.2f}x) |"
        )
    return "\n".join(lines)


def plot(variance_rows, runs, settings: Settings, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    taus = [r["tau"] for r in variance_rows]
    for c in CORRECTIONS:
        means = [r[f"{c}_norm_mean"] for r in variance_rows]
        stds = [r[f"{c}_norm_std"] for r in variance_rows]
        left.errorbar(taus, means, yerr=stds, marker="o", capsize=3, label=LABELS[c], color=COLORS[c])
    left.set(xlabel="staleness tau (optimizer steps)", ylabel="gradient norm (mean ± std over batches)",
             title="(1) gradient norm vs staleness")  # fmt: skip
    left.legend()
    tau_show = 16 if 16 in settings.staleness else max(settings.staleness)
    for tau, style in ((0, "-"), (tau_show, "--")):
        for c in settings.learning_corrections:
            group = [r for r in runs if r["tau"] == tau and r["correction"] == c]
            if not group:
                continue
            steps = [s for s, _ in group[0]["curve"]]
            mean = [sum(r["curve"][i][1] for r in group) / len(group) for i in range(len(steps))]
            label = "on-policy (tau=0)" if tau == 0 else f"{LABELS[c]}, tau={tau}"
            color = "black" if tau == 0 else COLORS[c]
            right.plot(steps, mean, style, marker=".", label=label, color=color)
    right.set(xlabel="optimizer step", ylabel="eval reward", title="(2) learning under forced staleness")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches, steps and seeds (all three tables)")
    parser.add_argument("--output-dir", default="outputs/staleness", help="where the PNG and the JSON go")
    parser.add_argument(
        "--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")),
        help="torch threads (default 1: on a busy 2-core machine 2 threads can run 5-10x slower)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = Settings.make(args.quick)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    print(f"# Staleness study ({'quick' if args.quick else 'full'}, {args.threads} threads)\n", flush=True)
    print("(1) gradient variance vs staleness ...", flush=True)
    variance_rows = gradient_variance(settings)
    print("(2) learning under forced staleness ...", flush=True)
    runs = learning_under_staleness(settings)
    print("(3) loss cost ...", flush=True)
    cost_rows = loss_cost(settings)

    plot(variance_rows, runs, settings, out / "staleness.png")
    report = {
        "settings": asdict(settings),
        "gradient_variance": variance_rows,
        "learning": runs,
        "loss_cost": cost_rows,
    }
    (out / "staleness.json").write_text(json.dumps(report, indent=1))

    print(f"\n## (1) Gradient norm vs staleness\n\nPolicy after {settings.variance_train_steps} on-policy GRPO steps; "
          f"behaviour = the snapshot tau steps older; {settings.variance_batches} batches of "
          f"{settings.prompts_per_step}x{settings.generations} completions per tau. tr Cov = mean ||g - mean g||^2 "
          "over batches (the estimator's variance).\n")  # fmt: skip
    print(table_variance(variance_rows))
    print(f"\n## (2) Learning under forced staleness\n\n{settings.train_steps} steps, seeds {list(settings.seeds)}; "
          f"final = mean reward of {settings.eval_sequences} completions sampled from the final policy; collapsed = "
          "non-finite loss or final < 50% of the run's best eval.\n")  # fmt: skip
    print(table_learning(runs, settings))
    print(f"\n## (3) Loss cost (forward + backward of the loss on the same tensors, {args.threads} CPU thread(s), "
          "median; ratios vs GRPO)\n")  # fmt: skip
    print(table_cost(cost_rows))
    print(f"\nPlot: {out / 'staleness.png'}  Data: {out / 'staleness.json'}  "
          f"Total: {time.perf_counter() - started:.0f} s")  # fmt: skip
    if not all(math.isfinite(r["final"]) for r in runs if not r["collapsed"]):
        raise SystemExit("non-finite final reward in a run not marked collapsed")


if __name__ == "__main__":
    main()
