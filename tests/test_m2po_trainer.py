"""AsyncM2POTrainer end to end on a tiny random Qwen2 (CPU, offline), and AsyncM2POConfig's selector/validation."""

import math

import pytest
import torch
from datasets import Dataset

from tests.conftest import make_tiny_qwen2
from trl_async import AsyncM2POConfig, AsyncM2POTrainer, second_moment_mask
from trl_async.m2po import aggregate_loss, m2po_per_token_loss


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def tiny_config(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        bf16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        max_staleness=1,
        learning_rate=1e-3,
        save_strategy="no",
    )
    kwargs.update(overrides)
    return AsyncM2POConfig(**kwargs)


def prompts():
    return Dataset.from_dict({"prompt": [f"Count to {i}:" for i in range(16)]})


def train(qwen_tokenizer, args, peft_config=None):
    model = make_tiny_qwen2(qwen_tokenizer)
    if args.beta != 0.0:  # TRL loads the reference model from the model's folder
        folder = f"{args.output_dir}/tiny-qwen2"
        model.save_pretrained(folder)
        qwen_tokenizer.save_pretrained(folder)
        model = folder
    trainer = AsyncM2POTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=prompts(),
        processing_class=qwen_tokenizer,
        peft_config=peft_config,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(before[n], p)]
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer, changed, logs


# ---- config ------------------------------------------------------------------------------------------------------


def test_config_selector_maps_onto_trl_importance_sampling(tmp_path):
    common = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none")
    m2po = AsyncM2POConfig(**common)
    assert (m2po.off_policy_correction, m2po.m2_threshold, m2po.m2po_epsilon) == ("m2po", 0.04, None)
    assert m2po.vllm_importance_sampling_correction  # TRL computes the proximal log-probs the mask needs
    tis = AsyncM2POConfig(**common, off_policy_correction="tis", off_policy_level="sequence")
    assert tis.vllm_importance_sampling_correction and tis.vllm_importance_sampling_mode == "sequence_truncate"
    mis = AsyncM2POConfig(**common, off_policy_correction="mis")
    assert mis.vllm_importance_sampling_mode == "token_mask"
    none = AsyncM2POConfig(**common, off_policy_correction="none")
    assert not none.vllm_importance_sampling_correction
    token = AsyncM2POConfig(**common, m2po_variant="token")
    assert not token.vllm_importance_sampling_correction


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(off_policy_correction="vtrace"), "off_policy_correction must be one of"),
        (dict(off_policy_level="batch"), "off_policy_level must be one of"),
        (dict(m2po_variant="clip"), "m2po_variant must be one of"),
        (dict(m2po_denominator="all"), "m2po_denominator must be one of"),
        (dict(m2_threshold=-0.1), "m2_threshold"),
        (dict(m2_threshold=math.nan), "m2_threshold"),
        (dict(m2po_epsilon=0.0), "m2po_epsilon"),
        (dict(m2po_gamma=0.0), "m2po_gamma"),
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
        (dict(importance_sampling_level="sequence"), "importance_sampling_level"),
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
    ],
)
def test_config_rejects_with_actionable_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        AsyncM2POConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", **overrides)


def test_config_allows_trl_options_for_trl_losses(tmp_path):
    config = AsyncM2POConfig(
        output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", off_policy_correction="tis",
        top_entropy_quantile=0.5,
    )  # fmt: skip
    assert config.top_entropy_quantile == 0.5


def test_trainer_requires_its_config(qwen_tokenizer, tmp_path):
    from trl_async import AsyncGRPOConfig

    args = AsyncGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none")
    with pytest.raises(TypeError, match="AsyncM2POConfig"):
        AsyncM2POTrainer(make_tiny_qwen2(qwen_tokenizer), length_reward, args=args, train_dataset=prompts())


# ---- end to end --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_trains_full_finetune_with_m2po_metrics(qwen_tokenizer, tmp_path):
    trainer, changed, logs = train(qwen_tokenizer, tiny_config(tmp_path, m2_threshold=1e-4))
    assert trainer.state.global_step == 3
    assert changed, "no parameter moved"
    assert all(math.isfinite(entry["loss"]) for entry in logs)
    for key in ("m2po/m2_before", "m2po/m2_after", "m2po/masked_fraction"):
        assert all(key in entry for entry in logs), key
    for entry in logs:
        assert 0.0 <= entry["m2po/masked_fraction"] <= 1.0
        assert entry["m2po/m2_after"] <= entry["m2po/m2_before"] + 1e-12
    # staleness 1 with lr 1e-3 moves the policy: stale batches were scored (a non-zero second moment) and, with a
    # tiny tau, masked
    stale = [e for e in logs if e.get("off_policy/staleness_max", 0) > 0]
    assert stale and any(e["m2po/m2_before"] > 0 for e in stale)
    assert any(e["m2po/masked_fraction"] > 0 for e in stale)


@pytest.mark.slow
def test_trains_lora(qwen_tokenizer, tmp_path):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer, changed, logs = train(qwen_tokenizer, tiny_config(tmp_path, learning_rate=1e-2), peft_config)
    assert trainer.state.global_step == 3
    assert changed and all("lora_" in name for name in changed)
    assert all(math.isfinite(entry["loss"]) for entry in logs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        dict(off_policy_correction="tis"),
        dict(off_policy_correction="mis", off_policy_level="sequence"),
        dict(off_policy_correction="none"),
        dict(m2po_variant="token"),
        dict(m2po_harmful_only=True, m2po_denominator="kept", loss_type="grpo", beta=0.1),
    ],
    ids=["tis", "mis-sequence", "none", "token-variant", "harmful-kept-grpo-kl"],
)
def test_every_correction_trains(qwen_tokenizer, tmp_path, overrides):
    trainer, changed, logs = train(qwen_tokenizer, tiny_config(tmp_path, max_steps=2, **overrides))
    assert trainer.state.global_step == 2 and changed
    assert all(math.isfinite(entry["loss"]) for entry in logs)
    if overrides.get("m2po_variant") == "token":
        assert all("m2po/clipped_fraction" in entry for entry in logs)


# ---- the loss wiring, on hand-made batches (no training loop) ----------------------------------------------------


def make_batch(trainer, qwen_tokenizer, stale: bool):
    torch.manual_seed(3)
    batch, prompt_len, length = 4, 3, 5
    vocab = len(qwen_tokenizer)
    completion_mask = torch.ones(batch, length, dtype=torch.long)
    completion_mask[2, 3:] = 0
    inputs = {
        "prompt_ids": torch.randint(0, vocab, (batch, prompt_len)),
        "prompt_mask": torch.ones(batch, prompt_len, dtype=torch.long),
        "completion_ids": torch.randint(0, vocab, (batch, length)),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2]),
        "num_items_in_batch": completion_mask.sum(),
    }
    if stale:
        with torch.no_grad():
            current = current_logps(trainer, inputs)
        inputs["old_per_token_logps"] = current  # proximal
        inputs["sampling_per_token_logps"] = current + 0.3 * torch.randn(batch, length)  # behaviour
    return inputs


def current_logps(trainer, inputs):
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, inputs["completion_ids"].size(1)
    )
    return logps


def loss_and_grads(trainer, loss_fn, inputs):
    trainer.model.zero_grad()
    loss = loss_fn(trainer.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


@pytest.fixture
def wired_trainer(qwen_tokenizer, tmp_path):
    def build(**overrides):
        trainer = AsyncM2POTrainer(
            model=make_tiny_qwen2(qwen_tokenizer),
            reward_funcs=length_reward,
            args=tiny_config(tmp_path, **overrides),
            train_dataset=prompts(),
            processing_class=qwen_tokenizer,
        )
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        return trainer

    return build


def test_fresh_batch_m2po_loss_equals_trl_grpo_loss(wired_trainer, qwen_tokenizer):
    from trl import GRPOTrainer

    trainer = wired_trainer()
    inputs = make_batch(trainer, qwen_tokenizer, stale=False)  # staleness 0: no behaviour log-probs
    ours, our_grads = loss_and_grads(trainer, trainer._compute_loss, inputs)
    trl, trl_grads = loss_and_grads(trainer, lambda m, x: GRPOTrainer._compute_loss(trainer, m, x), inputs)
    torch.testing.assert_close(ours, trl)
    for a, b in zip(our_grads, trl_grads):
        torch.testing.assert_close(a, b)


def test_stale_batch_infinite_threshold_is_unclipped_importance_weighted_pg(wired_trainer, qwen_tokenizer):
    trainer = wired_trainer(m2_threshold=float("inf"))
    inputs = make_batch(trainer, qwen_tokenizer, stale=True)
    inputs.update(trainer._second_moment_keep_mask(inputs))
    assert torch.equal(inputs["m2po_keep_mask"], inputs["completion_mask"].bool())
    mask = inputs["completion_mask"].bool()

    def reference(model, x):  # -(exp(logp - behaviour) * A), token mean (dapo), nothing masked, no clip, no IS ratio
        ratio = torch.exp(current_logps(trainer, x) - x["sampling_per_token_logps"])
        return -(ratio * x["advantages"][:, None])[mask].sum() / mask.sum()

    ours, our_grads = loss_and_grads(trainer, trainer._compute_loss, inputs)
    ref, ref_grads = loss_and_grads(trainer, reference, inputs)
    torch.testing.assert_close(ours, ref)
    for a, b in zip(our_grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_generation_batch_mask_is_the_pure_function_of_proximal_minus_behaviour(wired_trainer, qwen_tokenizer):
    trainer = wired_trainer(m2_threshold=0.02)
    inputs = make_batch(trainer, qwen_tokenizer, stale=True)
    extra = trainer._second_moment_keep_mask(inputs)
    log_ratio = inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]
    expected = second_moment_mask(log_ratio, inputs["completion_mask"].bool(), 0.02)
    assert torch.equal(extra["m2po_keep_mask"], expected)
    assert 0 < expected.sum() < inputs["completion_mask"].sum()  # some masked, some kept
    assert extra["m2po_num_kept"].item() == expected.sum().item()
    logged = trainer._metrics["train"]
    assert logged["m2po/masked_fraction"][-1] == pytest.approx(1 - expected.sum().item() / 18)
    assert logged["m2po/m2_after"][-1] <= 0.02 < logged["m2po/m2_before"][-1]
    # masked tokens get no gradient: perturbing their behaviour log-probs leaves the loss unchanged
    inputs.update(extra)
    loss = trainer._compute_loss(trainer.model, inputs).detach()
    moved = dict(inputs, sampling_per_token_logps=inputs["sampling_per_token_logps"] + 5.0 * (~expected))
    torch.testing.assert_close(trainer._compute_loss(trainer.model, moved).detach(), loss)


def test_eval_without_a_generation_batch_mask_uses_the_batch_own_mask(wired_trainer, qwen_tokenizer):
    trainer = wired_trainer(m2_threshold=0.02, m2po_epsilon=0.2)
    inputs = make_batch(trainer, qwen_tokenizer, stale=True)
    trainer.model.eval()  # no m2po_keep_mask in eval: the loss masks with current - behaviour of this batch
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs)
        log_ratio = current_logps(trainer, inputs) - inputs["sampling_per_token_logps"]
    keep = second_moment_mask(log_ratio, inputs["completion_mask"].bool(), 0.02)
    per_token = m2po_per_token_loss(log_ratio, inputs["advantages"], keep, 0.2, 0.2)
    expected, _ = aggregate_loss(
        per_token, inputs["completion_mask"], "dapo", num_items_in_batch=inputs["num_items_in_batch"], training=False
    )
    torch.testing.assert_close(loss, expected)


# ---- two real processes: the mask is global ----------------------------------------------------------------------

TWO_RANK_SCRIPT = """
import json, sys
from collections import defaultdict
from types import SimpleNamespace

import torch
from accelerate import Accelerator

from trl_async.async_m2po_trainer import AsyncM2POTrainer

accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
generator = torch.Generator().manual_seed(0)  # the same global batch on both ranks
log_ratio = torch.randn(6, 6, generator=generator) * 0.4  # (2 ranks x 3 rows, 6)
valid = torch.rand(6, 6, generator=generator) > 0.2
length = 4 if rank == 0 else 6  # ranks hold different completion lengths: padded before the gather
rows = slice(3 * rank, 3 * rank + 3)
output = {
    "completion_mask": valid[rows, :length].long(),
    "old_per_token_logps": log_ratio[rows, :length],
    "sampling_per_token_logps": torch.zeros(3, length),
    "advantages": torch.ones(3),
}
stub = SimpleNamespace(
    accelerator=accelerator,
    args=SimpleNamespace(m2po_harmful_only=False, m2_threshold=float(sys.argv[2])),
    _metrics={"train": defaultdict(list)},
)
extra = AsyncM2POTrainer._second_moment_keep_mask(stub, output)
result = {"keep": extra["m2po_keep_mask"].tolist(), "num_kept": extra["m2po_num_kept"].item(),
          "metrics": dict(stub._metrics["train"])}
with open(f"{sys.argv[1]}.{rank}.json", "w") as f:
    json.dump(result, f)
"""


@pytest.mark.slow
def test_two_processes_compute_one_global_mask(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = tmp_path / "two_rank_mask.py"
    script.write_text(TWO_RANK_SCRIPT)
    out, tau = tmp_path / "mask", 0.05
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(root / "recipes/accelerate_configs/multi_cpu_2proc.yaml"),
        "--main_process_port", "29531", str(script), str(out), str(tau),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in (0, 1)]

    generator = torch.Generator().manual_seed(0)
    log_ratio = torch.randn(6, 6, generator=generator) * 0.4
    valid = torch.rand(6, 6, generator=generator) > 0.2
    valid[:3, 4:] = False  # rank 0's completions are 4 tokens long
    expected = second_moment_mask(log_ratio, valid, tau)
    assert 0 < expected.sum() < valid.sum()  # the case is not trivial
    assert ranks[0]["keep"] == expected[:3, :4].tolist()
    assert ranks[1]["keep"] == expected[3:].tolist()
    assert ranks[0]["num_kept"] == ranks[1]["num_kept"] == expected.sum().item()
    assert ranks[0]["metrics"] == ranks[1]["metrics"]  # same global m2_before / m2_after / masked_fraction
