"""``AsyncM2POTrainer``: :class:`~trl_async.AsyncGRPOTrainer` with an off-policy-corrected loss; nothing else changes.

M2PO (Zheng, Zhao & Chen 2025, "Prosperity before Collapse", https://arxiv.org/abs/2510.01161), in the paper's order
and names, per valid completion token ``t`` of a generation batch:

    log_ratio_t = log pi_prox(o_t) - log pi_behav(o_t)        (for the mask, fixed for the optimizer step)
    M2          = mean_t log_ratio_t ** 2
    M_t         = 1 if M2 <= tau; else mask the largest log_ratio_t**2 until the kept mean is <= tau
    L(theta)    = -1/Z sum_t M_t * exp(log pi_theta(o_t) - log pi_behav(o_t)) * A_t   (+ beta * KL, as TRL)

``pi_behav`` is the snapshot that generated the token (the engine's behaviour log-probs, TRL's
``sampling_per_token_logps``); ``pi_theta`` the policy being trained (with gradient); ``Z`` the ``loss_type``
normaliser (:func:`trl_async.m2po.aggregate_loss`); ``tau`` = ``m2_threshold``. No epsilon-clip by default.

Which log-probs the mask uses, and why: the paper's ``M2`` uses ``pi_theta`` at the start of the update. We use
TRL's ``old_per_token_logps``: the current policy scoring the batch once, without gradient, when the generation batch
is prepared (AReaL's "proximal" policy, ``prox_logp`` in its ``_apply_m2po_masking``). It is that same policy, so the
mask is the paper's, and being fixed it is computed once per generation batch (one optimizer step with TRL's default
``steps_per_generation == gradient_accumulation_steps``) over the whole batch gathered from every process: every
process applies the same global threshold, and every micro-batch of the step uses the same mask.

The M2PO loss never multiplies by TRL's importance-sampling ratio (``vllm_importance_sampling_correction`` is left on
only so that TRL computes the proximal log-probs; the ratio is logged under ``sampling/*`` and otherwise unused).

Other corrections (``off_policy_correction``) run TRL's own loss unchanged: ``"tis"``/``"mis"`` = TRL's truncated /
masked importance sampling at token or sequence level; ``"none"`` = PPO clip with the ratio against the behaviour
log-probs. Batches the generator made with the current weights (staleness 0, exact HF engine) have no behaviour
log-probs: then ``log_ratio = 0``, nothing is masked and every correction reduces to on-policy GRPO.

Metrics (train, per generation batch, global): ``m2po/m2_before``, ``m2po/m2_after`` (second moment over valid /
kept tokens), ``m2po/masked_fraction``; the token variant logs ``m2po/masked_fraction`` and
``m2po/clipped_fraction`` per micro-batch.
"""

from __future__ import annotations

import torch

from .async_grpo_trainer import AsyncGRPOTrainer
from .async_m2po_config import AsyncM2POConfig
from .m2po import (
    aggregate_loss,
    harmful_second_moment_mask,
    m2po_per_token_loss,
    masked_second_moment,
    second_moment_mask,
    token_variant_per_token_loss,
)


class AsyncM2POTrainer(AsyncGRPOTrainer):
    """:class:`AsyncGRPOTrainer` whose only change is the loss: M2PO, or the correction chosen by
    ``AsyncM2POConfig.off_policy_correction`` (see the module docstring). Same constructor; ``args`` must be an
    :class:`AsyncM2POConfig`."""

    _tag_names = ["trl", "grpo", "trl_async", "async-grpo", "m2po"]
    _config_class = AsyncM2POConfig

    @property
    def _uses_m2po_loss(self) -> bool:
        return self.args.off_policy_correction == "m2po"

    # ---- the mask: once per generation batch, over every process --------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self._uses_m2po_loss and self.args.m2po_variant == "second_moment" and self.model.training:
            output.update(self._second_moment_keep_mask(output))
        return output

    def _second_moment_keep_mask(self, output: dict) -> dict:
        valid = _valid_mask(output)  # (B, T)
        proximal, behaviour = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
        if proximal is None or behaviour is None:  # fresh batch: behaviour == current policy
            log_ratio = torch.zeros(valid.shape, device=valid.device)  # (B, T)
        else:
            log_ratio = (proximal - behaviour).float()  # (B, T)
        accelerator = self.accelerator
        # every process gathers the values (padded to a common length) and computes the same global mask
        all_log_ratio = accelerator.gather(accelerator.pad_across_processes(log_ratio, dim=1))  # (P*B, T_max)
        all_valid = accelerator.gather(accelerator.pad_across_processes(valid.float(), dim=1)).bool()  # (P*B, T_max)
        if self.args.m2po_harmful_only:
            all_advantages = accelerator.gather(output["advantages"])  # (P*B,)
            all_keep = harmful_second_moment_mask(all_log_ratio, all_valid, all_advantages, self.args.m2_threshold)
        else:
            all_keep = second_moment_mask(all_log_ratio, all_valid, self.args.m2_threshold)
        batch_size, length = valid.shape
        start = accelerator.process_index * batch_size
        keep = all_keep[start : start + batch_size, :length]  # (B, T) this process's rows

        num_valid = all_valid.sum()
        metrics = self._metrics["train"]
        metrics["m2po/m2_before"].append(masked_second_moment(all_log_ratio, all_valid).item())
        metrics["m2po/m2_after"].append(masked_second_moment(all_log_ratio, all_keep).item())
        metrics["m2po/masked_fraction"].append((1 - all_keep.sum() / num_valid.clamp(min=1)).item())
        return {"m2po_keep_mask": keep, "m2po_num_kept": all_keep.sum().float()}

    # ---- the loss -------------------------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        if not self._uses_m2po_loss:
            behaviour = inputs.get("sampling_per_token_logps")
            if self.args.off_policy_correction == "none" and behaviour is not None:
                inputs = {**inputs, "old_per_token_logps": behaviour}  # PPO ratio against the behaviour policy
            return super()._compute_loss(model, inputs)
        return self._m2po_loss(model, inputs)

    def _m2po_loss(self, model, inputs):
        args = self.args
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, inputs["completion_mask"]], dim=1)
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            pixel_values=inputs.get("pixel_values"),
            image_grid_thw=inputs.get("image_grid_thw"),
            num_images=inputs.get("num_images"),
            pixel_attention_mask=inputs.get("pixel_attention_mask"),
            spatial_shapes=inputs.get("spatial_shapes"),
            num_tiles=inputs.get("num_tiles"),
            image_sizes=inputs.get("image_sizes"),
            token_type_ids=inputs.get("token_type_ids"),
            mm_token_type_ids=inputs.get("mm_token_type_ids"),
            image_position_ids=inputs.get("image_position_ids"),
        )  # (B, T)
        valid = _valid_mask(inputs)  # (B, T)
        advantages = inputs["advantages"]  # (B,) or (B, T)
        behaviour = inputs.get("sampling_per_token_logps")
        if behaviour is None:  # fresh batch: the generating policy is the scoring one
            behaviour = inputs.get("old_per_token_logps", per_token_logps.detach())
        log_ratio = per_token_logps - behaviour  # (B, T) log r_t, with gradient

        if args.m2po_variant == "second_moment":
            keep = inputs.get("m2po_keep_mask")
            if keep is None:  # evaluation: no generation-batch mask, use this batch's own
                keep = self._local_keep_mask(log_ratio.detach(), valid, advantages)
            eps = args.m2po_epsilon
            per_token_loss = m2po_per_token_loss(log_ratio, advantages, keep, eps, eps)  # (B, T)
            clipped = None
        else:
            per_token_loss, keep, clipped = token_variant_per_token_loss(
                log_ratio, advantages, valid, args.m2po_gamma, self.epsilon_low, self.epsilon_high
            )

        if self.beta != 0.0:
            ref_per_token_logps = inputs["ref_per_token_logps"]
            per_token_kl = (
                torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
            )
            if args.use_bias_correction_kl:
                per_token_kl = per_token_kl * torch.exp(torch.where(valid, log_ratio, 0.0))
            per_token_loss = per_token_loss + self.beta * per_token_kl

        if args.m2po_variant == "token" or args.m2po_denominator == "kept":  # token variant: the seed's 1/Z_m
            denominator_mask, num_items = keep, inputs.get("m2po_num_kept")
            if num_items is None:
                num_items = self._estimate_num_kept(inputs.get("num_items_in_batch"), keep, valid)
        else:
            denominator_mask, num_items = valid, inputs.get("num_items_in_batch")
        loss, _ = aggregate_loss(
            per_token_loss,
            denominator_mask,
            self.loss_type,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=num_items,
            num_processes=self.accelerator.num_processes,
            gradient_accumulation_steps=self.current_gradient_accumulation_steps,
            steps_per_generation=args.steps_per_generation,
            training=mode == "train",
        )
        if self.aux_loss_enabled:
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        def global_masked_mean(x, mask):
            totals = self.accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum().float()]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        metrics = self._metrics[mode]
        metrics["entropy"].append(global_masked_mean(entropies, valid))
        if self.beta != 0.0:
            metrics["kl"].append(global_masked_mean(per_token_kl, valid))
        if clipped is not None:  # token variant: per micro-batch
            metrics["m2po/masked_fraction"].append(global_masked_mean((~keep).float(), valid))
            metrics["m2po/clipped_fraction"].append(global_masked_mean(clipped.float(), valid))
        return loss

    def _local_keep_mask(self, log_ratio, valid, advantages):
        if self.args.m2po_harmful_only:
            return harmful_second_moment_mask(log_ratio, valid, advantages, self.args.m2_threshold)
        return second_moment_mask(log_ratio, valid, self.args.m2_threshold)

    def _estimate_num_kept(self, num_items, keep, valid):
        """Kept tokens in the generation batch, estimated from this micro-batch's kept share over all processes
        (masks made per micro-batch have no generation-batch count)."""
        if num_items is None:
            return None
        share = self.accelerator.reduce(torch.stack([keep.sum(), valid.sum()]).float(), reduction="sum")
        return num_items * share[0] / share[1].clamp(min=1.0)


def _valid_mask(batch: dict) -> torch.Tensor:
    """Completion tokens that count in the loss: ``completion_mask`` (times ``tool_mask`` when present), bool."""
    mask = batch["completion_mask"].bool()
    if batch.get("tool_mask") is not None:
        mask = mask & batch["tool_mask"].bool()
    return mask
