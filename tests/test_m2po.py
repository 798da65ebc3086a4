"""The M2PO pure functions (trl_async/m2po.py): hand-built cases, a property test against a slow reference, gradients,
the seed's token variant, and TRL 1.16's loss_type normalisers checked against TRL's own `_compute_loss`."""

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_async import second_moment_mask
from trl_async.m2po import (
    aggregate_loss,
    harmful_quadrant,
    harmful_second_moment_mask,
    m2po_per_token_loss,
    masked_second_moment,
    token_variant_per_token_loss,
)

TAU = 0.04


def mask_of(log_ratio, valid=None, tau=TAU):
    log_ratio = torch.tensor(log_ratio, dtype=torch.float32)
    valid = torch.ones_like(log_ratio, dtype=torch.bool) if valid is None else torch.tensor(valid, dtype=torch.bool)
    return second_moment_mask(log_ratio, valid, tau).tolist()


# ---- hand-built cases with known answers -------------------------------------------------------------------------


def test_m2_under_tau_masks_nothing():
    assert mask_of([[0.1, -0.1, 0.15], [0.0, 0.05, -0.19]]) == [[True] * 3] * 2


def test_m2_exactly_tau_masks_nothing():
    assert mask_of([[0.25, -0.25]], tau=0.0625) == [[True, True]]  # M2 == tau exactly (dyadic values)


def test_one_outlier_is_exactly_the_masked_token():
    log_ratio = [[0.1, -0.1, 0.05, 0.0], [0.1, 2.0, -0.1, 0.05]]
    assert mask_of(log_ratio) == [[True, True, True, True], [True, False, True, True]]


def test_masks_largest_first_until_kept_mean_under_tau():
    # m2 = 1, 0.25, 0.0625, 0 (mean 0.328); drop 1 -> mean 0.104; drop 0.25 -> mean 0.03125 <= 0.04
    assert mask_of([[1.0, -0.5, 0.25, 0.0]]) == [[False, False, True, True]]


def test_sign_does_not_matter():
    assert mask_of([[-2.0, 0.1, 0.1]]) == mask_of([[2.0, 0.1, 0.1]]) == [[False, True, True]]


def test_ties_are_masked_together():
    # m2 = 0.25, 0.25, 0 x 6: masking one 0.25 gives mean 0.0357 <= 0.04, but its twin is masked too
    assert mask_of([[0.5, -0.5, 0, 0, 0, 0, 0, 0]]) == [[False, False] + [True] * 6]


def test_ties_below_the_cut_are_all_kept():
    assert mask_of([[3.0, 0.1, -0.1, 0.1]]) == [[False, True, True, True]]


def test_all_masked_edge_case_keeps_the_smallest():
    assert mask_of([[3.0, -2.0, 2.5]]) == [[False, True, False]]


def test_all_masked_edge_case_keeps_the_smallest_tie():
    assert mask_of([[3.0, 3.0, -3.0]]) == [[True, True, True]]  # nothing smaller to keep: the whole tie stays


def test_padding_never_counted():
    valid = [[True, True, True, False, False], [True, True, False, False, False]]
    kept = mask_of([[0.1, 0.1, 0.1, 50.0, -50.0], [0.1, -0.1, 9.0, 9.0, 9.0]], valid)
    assert kept == valid  # the huge padded values neither count towards M2 nor get "kept"
    padded_nan = mask_of([[0.1, 0.1, 0.1, float("nan"), float("inf")], [0.1, -0.1, 0, 0, 0]], valid)
    assert padded_nan == valid


def test_non_finite_valid_tokens_are_masked():
    assert mask_of([[0.1, float("nan"), float("inf"), -float("inf"), 0.0]]) == [[True, False, False, False, True]]


def test_no_valid_token_keeps_nothing_and_empty_input_works():
    assert mask_of([[1.0, 2.0]], [[False, False]]) == [[False, False]]
    empty = second_moment_mask(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool), TAU)
    assert empty.shape == (0, 3)


def test_infinite_threshold_keeps_every_valid_token():
    log_ratio = torch.randn(4, 7) * 3
    valid = torch.rand(4, 7) > 0.3
    assert torch.equal(second_moment_mask(log_ratio, valid, float("inf")), valid)


def test_mask_ignores_token_order():
    torch.manual_seed(0)
    log_ratio = torch.randn(6, 9)
    log_ratio[0, :3] = 0.5  # a tie
    valid = torch.rand(6, 9) > 0.2
    kept = second_moment_mask(log_ratio, valid, TAU)
    perm = torch.randperm(54)
    kept_perm = second_moment_mask(log_ratio.view(-1)[perm], valid.view(-1)[perm], TAU)
    assert torch.equal(kept_perm, kept.view(-1)[perm])


def test_masked_second_moment():
    log_ratio = torch.tensor([[1.0, 2.0, 3.0]])
    assert masked_second_moment(log_ratio, torch.tensor([[True, True, False]])).item() == pytest.approx(2.5)
    assert masked_second_moment(log_ratio, torch.zeros(1, 3, dtype=torch.bool)).item() == 0.0


# ---- harmful-quadrant variant ------------------------------------------------------------------------------------


def test_harmful_quadrant():
    log_ratio = torch.tensor([[0.5, -0.5, 0.5, -0.5, 0.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    assert harmful_quadrant(log_ratio, advantages).tolist() == [[True, False, False, True, False]]


def test_harmful_variant_only_masks_harmful_tokens():
    # row 0: A>0, row 1: A<0. Large |log_ratio| in both directions; only r>1 (row 0) and r<1 (row 1) may go.
    log_ratio = torch.tensor([[2.0, -2.0, 0.1, 0.0], [2.0, -2.0, -0.1, 0.0]])
    advantages = torch.tensor([1.0, -1.0])
    valid = torch.ones(2, 4, dtype=torch.bool)
    kept = harmful_second_moment_mask(log_ratio, valid, advantages, TAU)
    assert kept.tolist() == [[False, True, True, True], [True, False, True, True]]
    # the plain rule masks all four outliers
    assert second_moment_mask(log_ratio, valid, TAU).tolist() == [[False, False, True, True]] * 2


# ---- property test against a slow, obviously-correct reference ---------------------------------------------------


def reference_mask(m2: list[float], valid: list[bool], tau: float) -> list[bool]:
    """Mask the largest m2 (with its ties) one value at a time while the kept mean exceeds tau, never the last value."""
    kept = [i for i, ok in enumerate(valid) if ok]
    while kept:
        values = [m2[i] for i in kept]
        if math.fsum(values) / len(values) <= tau:
            break
        top = max(values)
        if min(values) == top:
            break  # only the smallest value is left: keep it
        kept = [i for i in kept if m2[i] != top]
    kept_set = set(kept)
    return [i in kept_set for i in range(len(m2))]


@st.composite
def grid_batches(draw):
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    eighths = draw(st.lists(st.integers(-24, 24), min_size=rows * cols, max_size=rows * cols))
    valid = draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))
    tau = draw(st.sampled_from([0.0, 0.01, 0.04, 0.1, 0.5, 1.0, 3.0]) | st.floats(0, 10, allow_nan=False))
    # multiples of 1/8: their squares (k**2/64) and all sums are exact, so float ties and sums mean what they say
    log_ratio = torch.tensor(eighths, dtype=torch.float32).view(rows, cols) / 8
    return log_ratio, torch.tensor(valid).view(rows, cols), tau


@settings(max_examples=400, deadline=None)
@given(grid_batches())
def test_property_matches_reference(batch):
    log_ratio, valid, tau = batch
    kept = second_moment_mask(log_ratio, valid, tau)
    m2 = [float(x) ** 2 for x in log_ratio.view(-1).tolist()]
    assert kept.view(-1).tolist() == reference_mask(m2, valid.view(-1).tolist(), tau)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 12),
    st.floats(1e-4, 2.0),
    st.floats(0.01, 4.0),
    st.integers(0, 2**31 - 1),
)
def test_property_invariants_on_real_valued_ratios(rows, cols, tau, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(rows, cols, generator=generator) * scale
    valid = torch.rand(rows, cols, generator=generator) > 0.25
    kept = second_moment_mask(log_ratio, valid, tau)
    m2 = log_ratio.float().square().double()  # the float32 squares the mask is made of
    assert not (kept & ~valid).any()  # only valid tokens are kept
    if not valid.any():
        assert not kept.any()
        return
    assert kept.any()  # at least one token is kept
    kept_m2, masked_m2 = m2[kept], m2[valid & ~kept]
    if masked_m2.numel():
        assert kept_m2.max() <= masked_m2.min()  # the masked tokens are exactly the largest
        # minimal: putting back the smallest masked value (with its ties) would break the bound
        back = torch.cat([kept_m2, masked_m2[masked_m2 == masked_m2.min()]])
        assert back.mean() > tau
    only_smallest_left = bool((kept_m2 == m2[valid].min()).all())  # the edge case: nothing fits under tau
    assert kept_m2.mean() <= tau * (1 + 1e-12) or only_smallest_left


# ---- the loss: gradients, tau = inf, clipping option -------------------------------------------------------------


def test_gradient_flows_only_through_kept_tokens():
    torch.manual_seed(0)
    behaviour = torch.randn(3, 5)
    current = (behaviour + torch.tensor([[0.1, 3.0, 0.0, -0.1, 0.05]])).requires_grad_(True)
    valid = torch.ones(3, 5, dtype=torch.bool)
    valid[2, 3:] = False
    advantages = torch.tensor([1.0, -0.5, 2.0])
    log_ratio = current - behaviour
    keep = second_moment_mask(log_ratio.detach(), valid, TAU)
    assert not keep[:, 1].any() and keep[:, 0].all()
    per_token = m2po_per_token_loss(log_ratio, advantages, keep)
    loss, _ = aggregate_loss(per_token, valid, "bnpo")
    loss.backward()
    assert torch.all(current.grad[~keep] == 0)
    assert torch.all(current.grad[keep] != 0)
    # d/dlogp of -(r A)/N is -(r A)/N on every kept token
    expected = -(torch.exp(log_ratio.detach()) * advantages[:, None]) / valid.sum()
    torch.testing.assert_close(current.grad[keep], expected[keep])


def test_masked_non_finite_tokens_give_zero_loss_and_finite_gradient():
    current = torch.tensor([[0.0, -1.0, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[0.0, float("nan"), -float("inf")]])
    log_ratio = current - behaviour
    keep = second_moment_mask(log_ratio.detach(), torch.ones(1, 3, dtype=torch.bool), TAU)
    assert keep.tolist() == [[True, False, False]]
    loss, _ = aggregate_loss(m2po_per_token_loss(log_ratio, torch.tensor([1.0]), keep), keep, "bnpo")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(current.grad).all()
    assert current.grad.tolist() == [[-1.0, 0.0, 0.0]]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_infinite_threshold_equals_unclipped_importance_weighted_pg(loss_type):
    torch.manual_seed(1)
    behaviour = torch.randn(4, 6)
    current = (behaviour + 0.8 * torch.randn(4, 6)).requires_grad_(True)
    valid = torch.rand(4, 6) > 0.2
    advantages = torch.randn(4)
    kwargs = dict(max_completion_length=6, num_items_in_batch=valid.sum(), gradient_accumulation_steps=2)

    log_ratio = current - behaviour
    keep = second_moment_mask(log_ratio.detach(), valid, float("inf"))
    loss, _ = aggregate_loss(m2po_per_token_loss(log_ratio, advantages, keep), valid, loss_type, **kwargs)
    (grad,) = torch.autograd.grad(loss, current)

    is_pg = -torch.exp(current - behaviour) * advantages[:, None]  # (B, T), no clip, no mask
    ref_loss, _ = aggregate_loss(is_pg, valid, loss_type, **kwargs)
    (ref_grad,) = torch.autograd.grad(ref_loss, current)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)


def test_optional_epsilon_clip_is_ppo_surrogate_on_kept_tokens():
    log_ratio = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    keep = torch.tensor([[True, True, False]])
    loss = m2po_per_token_loss(log_ratio, torch.tensor([1.0]), keep, epsilon_low=0.2, epsilon_high=0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, 0.0]]))


# ---- the seed's token variant -----------------------------------------------------------------------------------


def test_token_variant_reproduces_seed_formula():
    # r = 0.5, 1.0, 1.5, 2.0 | 0.5, 1.0, 1.5, 2.0 ; A = +1 | -2 ; gamma = 2 -> r**2 <= 2 keeps r in {0.5, 1, 1.5(2.25? no)}
    ratio = torch.tensor([[0.5, 1.0, 1.5, 2.0], [0.5, 1.0, 1.25, 2.0]])
    advantages = torch.tensor([1.0, -2.0])
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    per_token, keep, clipped = token_variant_per_token_loss(
        torch.log(ratio), advantages, valid, gamma=2.0, epsilon_low=0.2, epsilon_high=0.2
    )
    # m = 1[r^2 <= 2]: 0.25, 1, 2.25, 4 | 0.25, 1, 1.5625, (padding)
    assert keep.tolist() == [[True, True, False, False], [True, True, True, False]]
    # -min(r A, clip(r, 0.8, 1.2) A) on kept tokens:
    #   A=+1: r=0.5 -> -min(0.5, 0.8) = -0.5 ; r=1 -> -1
    #   A=-2: r=0.5 -> -min(-1, -1.6) = 1.6 (clipped) ; r=1 -> 2 ; r=1.25 -> -min(-2.5, -2.4) = 2.5
    expected = torch.tensor([[-0.5, -1.0, 0.0, 0.0], [1.6, 2.0, 2.5, 0.0]])
    torch.testing.assert_close(per_token, expected)
    assert clipped.tolist() == [[False, False, False, False], [True, False, False, False]]
    # the seed's L = -1/Z_m sum m * min(...), Z_m = number of kept tokens
    loss, _ = aggregate_loss(per_token, keep, "bnpo")
    torch.testing.assert_close(loss, expected.sum() / 5)


# ---- aggregate_loss reproduces TRL 1.16's normalisers (checked against TRL's own _compute_loss) ---------------------


def trl_compute_loss(
    loss_type, per_token_logps, completion_mask, advantages, *, ga_steps, steps_per_generation, training
):
    """Run TRL's real `GRPOTrainer._compute_loss` on a stub trainer whose forward returns `per_token_logps`."""
    from trl import GRPOTrainer

    B, T = completion_mask.shape
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (per_token_logps, torch.zeros(B, T), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=0.0,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=training),
        current_gradient_accumulation_steps=ga_steps,
        max_completion_length=T + 3,
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
        _entropy_bonus_enabled=False,
        _metrics={
            "train": __import__("collections").defaultdict(list),
            "eval": __import__("collections").defaultdict(list),
        },
        args=SimpleNamespace(
            delta=None,
            use_bias_correction_kl=False,
            sapo_temperature_pos=1.0,
            sapo_temperature_neg=1.05,
            steps_per_generation=steps_per_generation,
        ),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": completion_mask.long(),
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum() * steps_per_generation + 3,
        "old_per_token_logps": per_token_logps.detach(),  # ratio 1: the per-token loss has a closed form
    }
    return GRPOTrainer._compute_loss(stub, None, inputs), inputs


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo"])
@pytest.mark.parametrize("training", [True, False])
def test_aggregate_loss_matches_trl(loss_type, training):
    torch.manual_seed(2)
    B, T = 4, 5
    per_token_logps = -torch.rand(B, T) - 0.1
    completion_mask = torch.ones(B, T, dtype=torch.bool)
    completion_mask[1, 3:] = False
    completion_mask[3, 1:] = False
    advantages = torch.tensor([1.0, -0.5, 0.25, -2.0])
    ga, spg = 3, 2
    trl_loss, inputs = trl_compute_loss(
        loss_type,
        per_token_logps,
        completion_mask,
        advantages,
        ga_steps=ga,
        steps_per_generation=spg,
        training=training,
    )
    A = advantages[:, None].expand(B, T)
    if loss_type == "cispo":  # -clamp(r, max=eps_high).detach() * A * logp with r = 1
        per_token = -min(1.0, 0.28) * A * per_token_logps
    elif loss_type == "sapo":  # -(4/t) sigmoid(t (r - 1)) A with r = 1
        per_token = -torch.where(A > 0, 2 / 1.0, 2 / 1.05) * A
    else:  # -min(r A, clip(r) A) with r = 1
        per_token = -A
    ours, policy_loss = aggregate_loss(
        per_token,
        completion_mask,
        loss_type,
        max_completion_length=T + 3,
        num_items_in_batch=inputs["num_items_in_batch"],
        gradient_accumulation_steps=ga,
        steps_per_generation=spg,
        training=training,
    )
    torch.testing.assert_close(ours, trl_loss)
    assert not policy_loss.requires_grad


def test_aggregate_loss_rejects_unknown_or_underspecified():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="Unknown loss_type"):
        aggregate_loss(x, x.bool(), "ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate_loss(x, x.bool(), "dr_grpo")
    with pytest.raises(ValueError, match="num_items_in_batch"):
        aggregate_loss(x, x.bool(), "dapo")
