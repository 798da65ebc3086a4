"""The "hf" engine on a real tiny Qwen2 with the real Qwen2.5 tokenizer: shapes, behaviour log-probs, sync."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from tests.conftest import make_tiny_qwen2
from trl_async.engines.hf_engine import HFGenerationEngine, snapshot_policy


def completion_logprobs(model, prompt, completion, temperature=1.0, top_k=None):
    """Reference: one full forward, log_softmax of (optionally top-k filtered) logits / temperature."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # (T, V)
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def make_engine(model, tok, **kw):
    kw.setdefault("max_completion_length", 12)
    return HFGenerationEngine(model, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id], **kw)


@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.7, None), (0.9, 20)])
def test_shapes_groups_and_behaviour_logprobs_match_a_forward_pass(qwen_tokenizer, temperature, top_k):
    tok = qwen_tokenizer
    model = make_tiny_qwen2(tok).eval()
    engine = make_engine(model, tok, temperature=temperature, top_k=top_k)
    prompts = [tok("What is 2+2?")["input_ids"], tok("Say hi")["input_ids"]]
    out = engine.generate(prompts, num_generations=3)
    assert len(out.completion_ids) == len(out.logprobs) == 6
    for k, (ids, lps) in enumerate(zip(out.completion_ids, out.logprobs)):
        assert len(ids) == len(lps) and 1 <= len(ids) <= 12
        if len(ids) < 12:
            assert ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:-1]
        ref = completion_logprobs(model, prompts[k // 3], ids, temperature, top_k)  # prompt-major groups
        torch.testing.assert_close(torch.tensor(lps), ref, atol=2e-4, rtol=1e-4)


def test_snapshot_shares_frozen_weights_and_copies_the_adapter(qwen_tokenizer):
    model = get_peft_model(make_tiny_qwen2(qwen_tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    snap = snapshot_policy(model)
    live, copied = dict(model.named_parameters()), dict(snap.named_parameters())
    for name, p in live.items():
        same_storage = p.data_ptr() == copied[name].data_ptr()
        assert same_storage == (not p.requires_grad), name
    assert not snap.training and not any(p.requires_grad for p in snap.parameters())


@pytest.mark.parametrize("use_lora", [False, True])
def test_weight_sync_makes_the_engine_generate_with_the_new_weights(qwen_tokenizer, use_lora):
    tok = qwen_tokenizer
    model = make_tiny_qwen2(tok)
    if use_lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    engine = make_engine(model, tok)
    update = engine.stage_weights(model)
    if use_lora:
        assert update and all("lora_" in name for name in update)  # adapter only
    with torch.no_grad():  # "train" the live model
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.5)
    prompt = tok("Hello")["input_ids"]
    stale = engine.generate([prompt], 2)
    ref_new = [completion_logprobs(model.eval(), prompt, ids) for ids in stale.completion_ids]
    assert any((torch.tensor(lps) - ref).abs().max() > 1e-2 for lps, ref in zip(stale.logprobs, ref_new))
    engine.load_weights(engine.stage_weights(model))
    fresh = engine.generate([prompt], 2)
    for ids, lps in zip(fresh.completion_ids, fresh.logprobs):
        torch.testing.assert_close(torch.tensor(lps), completion_logprobs(model, prompt, ids), atol=2e-4, rtol=1e-4)


def test_too_long_prompt_is_a_clear_error(qwen_tokenizer):
    engine = make_engine(make_tiny_qwen2(qwen_tokenizer), qwen_tokenizer, max_model_length=64)
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        engine.generate([[5] * 60], 2)


def test_cancel_cuts_a_generation_short(qwen_tokenizer):
    engine = make_engine(make_tiny_qwen2(qwen_tokenizer), qwen_tokenizer, max_completion_length=200)
    engine.cancel.set()
    out = engine.generate([[5, 6, 7]], 2)
    assert all(len(ids) <= 2 for ids in out.completion_ids)


def test_snapshot_of_a_trl_patched_model_uses_its_own_weights(qwen_tokenizer):
    """GRPOTrainer patches `model.forward` with a closure over the live model; the snapshot must not call it."""
    from trl.trainer.utils import add_fused_lm_head

    model = make_tiny_qwen2(qwen_tokenizer)
    add_fused_lm_head(model)
    snap = snapshot_policy(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = snap(ids).logits
        for p in model.parameters():
            p.add_(1.0)  # the live model moves on
        after = snap(ids).logits
    torch.testing.assert_close(before, after)
