"""The ``"hf"`` engine: ``transformers.generate`` on a private snapshot of the policy, in the worker thread.

* **Snapshot.** A deep copy of the (unwrapped) policy that *shares* every frozen parameter with the training model
  and copies only the trainable ones: with LoRA the snapshot costs the adapter tensors, with full fine-tuning one
  copy of the weights. The snapshot is in eval mode and only ever used under ``torch.no_grad()``.
* **Weight sync.** :meth:`stage_weights` (main thread) clones the trainable tensors; :meth:`load_weights` (worker
  thread, between two generations) copies them into the snapshot. A generation therefore never sees a
  half-updated snapshot, and the trainer never waits for a generation to finish.
* **Behaviour log-probs.** Sampling warpers (repetition penalty, temperature, top-k, top-p, min-p) are applied by
  this engine, in that order, followed by a recorder; the recorded ``log_softmax`` of the final processed scores at
  the sampled token is exactly the log-prob of the distribution the token was drawn from.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import types
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .base import EngineOutput


def snapshot_policy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` that shares its frozen parameters and copies its trainable ones (eval mode)."""
    shared = {id(p): p for p in model.parameters() if not p.requires_grad}
    snapshot = copy.deepcopy(model, memo=shared)
    for module in snapshot.modules():
        # TRL's `add_fused_lm_head` replaces `forward` on the instance with a closure over the *original* model's
        # bound forward; deep-copied, it would keep generating with the training model. Use the class forward.
        patched = module.__dict__.get("forward")
        if isinstance(patched, types.MethodType) and hasattr(patched.__func__, "__wrapped__"):
            del module.__dict__["forward"]
    snapshot.eval()
    base = snapshot.get_base_model() if hasattr(snapshot, "get_base_model") else snapshot
    checkpointing = getattr(base, "is_activation_checkpointing", None)
    if checkpointing is None:  # transformers < 5.x name
        checkpointing = getattr(base, "is_gradient_checkpointing", False)
    if checkpointing:
        base.gradient_checkpointing_disable()  # checkpointing would also switch the KV cache off
    for p in snapshot.parameters():
        p.requires_grad_(False)
    return snapshot


class _BehaviourLogprobRecorder(LogitsProcessor):
    """Last processor of the chain: keeps ``log_softmax(scores)`` of each step until its token is known."""

    def __init__(self):
        self.step_logprobs: list[torch.Tensor] = []  # one (N,) tensor per generated token
        self._previous: torch.Tensor | None = None  # (N, V) log-probs of the last step, token not yet sampled

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._previous is not None:  # input_ids[:, -1] was sampled from the previous step's distribution
            self.step_logprobs.append(self._previous.gather(1, input_ids[:, -1:]).squeeze(1))
        self._previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, completion_ids: torch.LongTensor) -> torch.Tensor:
        """(N, T) behaviour log-probs of ``completion_ids`` (N, T), the tokens generated after the prompt."""
        num_tokens = completion_ids.size(1)
        if self._previous is not None and len(self.step_logprobs) < num_tokens:
            last = completion_ids[:, len(self.step_logprobs) : len(self.step_logprobs) + 1]
            self.step_logprobs.append(self._previous.gather(1, last).squeeze(1))
        self._previous = None
        return torch.stack(self.step_logprobs[:num_tokens], dim=1)


class _StopWhenRequested(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.size(0),), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class HFGenerationEngine:
    """Generates with ``transformers`` on a snapshot of the policy. See the module docstring for the invariants."""

    exact_behaviour_logps = True  # same weights + same numerics as the trainer's forward: IS ratio is 1 when fresh

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        eos_token_ids: list[int],
        max_completion_length: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        generation_kwargs: dict[str, Any] | None = None,
        max_model_length: int | None = None,
    ):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}.")
        self.model = snapshot_policy(model)
        self.device = next(self.model.parameters()).device
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.max_completion_length = max_completion_length
        self.max_model_length = max_model_length
        self._stream = None  # CUDA stream of the worker thread, created on first use
        self.cancel = threading.Event()  # set by the worker's stop(): cuts an in-flight generation short
        self._warpers: list[LogitsProcessor] = []
        if repetition_penalty != 1.0:
            self._warpers.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
        if temperature != 1.0:
            self._warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            self._warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self._warpers.append(TopPLogitsWarper(top_p))
        if min_p is not None:
            self._warpers.append(MinPLogitsWarper(min_p))
        # Warpers are ours (above), so the generation config itself must not add any.
        self.generation_config = GenerationConfig(
            **{**(generation_kwargs or {})},
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_completion_length,
            pad_token_id=pad_token_id,
            eos_token_id=self.eos_token_ids,
            bos_token_id=None,
            use_cache=True,
        )

    @classmethod
    def from_trainer(cls, trainer) -> HFGenerationEngine:
        args = trainer.args
        model = trainer.accelerator.unwrap_model(trainer.model)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        return cls(
            model=model,
            pad_token_id=trainer._tokenizer.pad_token_id,
            eos_token_ids=trainer.eos_token_ids,
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            generation_kwargs=args.generation_kwargs,
            max_model_length=getattr(config, "max_position_embeddings", None),
        )

    # ---- worker thread ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_generations: int) -> EngineOutput:
        self._check_lengths(prompt_ids)
        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]  # prompt-major, (P*G) rows
        width = max(len(ids) for ids in repeated)
        input_ids = torch.full((len(repeated), width), self.pad_token_id, dtype=torch.long)  # (N, P_max), left-padded
        attention_mask = torch.zeros((len(repeated), width), dtype=torch.long)  # (N, P_max)
        for row, ids in enumerate(repeated):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        recorder = _BehaviourLogprobRecorder()
        with self._stream_context():
            sequences = self._generate(input_ids, attention_mask, recorder)
            completion_ids = sequences[:, width:]  # (N, T)
            logprobs = recorder.finish(completion_ids)  # (N, T)
            is_eos = torch.isin(completion_ids, torch.tensor(self.eos_token_ids, device=completion_ids.device))
            has_eos = is_eos.any(dim=1)
            lengths = torch.where(has_eos, is_eos.int().argmax(dim=1) + 1, completion_ids.size(1))  # (N,) EOS incl.
            ids_cpu, lps_cpu, lengths = completion_ids.cpu(), logprobs.cpu(), lengths.tolist()
        return EngineOutput(
            completion_ids=[ids_cpu[i, :n].tolist() for i, n in enumerate(lengths)],
            logprobs=[lps_cpu[i, :n].tolist() for i, n in enumerate(lengths)],
        )

    def _stream_context(self):
        """On CUDA, the worker's kernels go to their own stream so they overlap the trainer's (default) stream."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return torch.cuda.stream(self._stream)

    def _generate(self, input_ids, attention_mask, recorder):
        return self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=self.generation_config,
            logits_processor=LogitsProcessorList([*self._warpers, recorder]),
            stopping_criteria=StoppingCriteriaList([_StopWhenRequested(self.cancel)]),
        )

    def _check_lengths(self, prompt_ids: list[list[int]]) -> None:
        if self.max_model_length is None:
            return
        for i, ids in enumerate(prompt_ids):
            if len(ids) + self.max_completion_length > self.max_model_length:
                raise ValueError(
                    f"Prompt {i} has {len(ids)} tokens; with max_completion_length={self.max_completion_length} it "
                    f"exceeds the model's {self.max_model_length} positions. Shorten or filter long prompts, or "
                    "lower `max_completion_length`."
                )

    @torch.no_grad()
    def load_weights(self, update: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        missing = update.keys() - params.keys()
        if missing:
            raise KeyError(f"Weight update names not in the snapshot: {sorted(missing)[:5]}")
        with self._stream_context():
            for name, tensor in update.items():
                params[name].copy_(tensor)
        if self.device.type == "cuda":
            self._stream.synchronize()

    # ---- main thread -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def stage_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Clone the trainable tensors of the (unwrapped) training model: the adapter only, with LoRA."""
        update = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the worker reads them from its own stream
        return update

    def close(self) -> None:
        self.cancel.set()
