"""The ``"vllm"`` engine in server mode: generation on separate GPUs, through TRL's ``VLLMClient``.

A ``vllm serve`` (or ``trl vllm-serve``) process owns the generation GPUs; the worker thread sends it token-id prompts
over HTTP and pushes weights over the NCCL weight-transfer group TRL's client opens (trainer = rank 0).

Threads: the client and the NCCL communicator are created in the constructor (main thread); ``generate`` and
``load_weights`` run on the worker thread (which selects the training device first: the CUDA current device is
per-thread); ``stage_weights`` runs on the main thread and only reads the model.

Invariants:

* ``generate`` returns ``P * G`` completions, prompt-major, stop tokens kept; ``logprobs[k][t]`` is the server's log-prob
  of the sampled token, which is the *processed* one when the server runs with ``--logprobs-mode processed_logprobs``
  (``trl vllm-serve`` sets it; for ``vllm serve`` pass it yourself).
* ``load_weights`` returns once the server holds the staged weights and its prefix cache is reset.
* LoRA: the adapter is merged (``W + delta``, read-only) and streamed as full weights — the server only knows the base.

An unreachable server raises ``ConnectionError`` naming the address within ``connection_timeout`` seconds (each probe
has its own short HTTP timeout, so a black-holed address cannot hang it).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from .base import EngineOutput
from .vllm_engine import StagedWeights, base_named_parameters, require_vllm


def wait_for_server(base_url: str, timeout: float, probe_timeout: float = 5.0) -> None:
    """Poll ``{base_url}/health`` until it answers 200, else raise ``ConnectionError`` after ``timeout`` seconds."""
    import requests

    url = f"{base_url.rstrip('/')}/health"
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        remaining = deadline - time.monotonic()
        try:
            response = requests.get(url, timeout=max(0.5, min(probe_timeout, remaining)))
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except requests.exceptions.RequestException as exc:
            last = f"{type(exc).__name__}"
        if time.monotonic() + 1.0 > deadline:
            raise ConnectionError(
                f"The vLLM server at {base_url} is unreachable ({last} from {url} for {timeout:g} s). Start it first, "
                "e.g. `CUDA_VISIBLE_DEVICES=1 trl vllm-serve --model <model>`, and check vllm_server_base_url / "
                "vllm_server_host / vllm_server_port (or raise vllm_server_timeout while it loads)."
            )
        time.sleep(1.0)


class VLLMServerEngine:
    """A ``vllm serve`` server behind the :class:`~trl_async.engines.base.GenerationEngine` seam.

    Args:
        base_url: ``http://host:port`` of the server (else ``host``/``port``).
        group_port: port of the NCCL weight-update group.
        connection_timeout: seconds to wait for the server to answer ``/health``.
        eos_token_ids: stop tokens (kept in the completions).
        device: CUDA device of the training process that joins the NCCL group; ``None`` = no weight sync (generation
            only, e.g. to test against a server without GPUs here).
        stage_device: where :meth:`stage_weights` keeps the snapshot (``"cpu"``: host RAM, no extra GPU memory).
        temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length, generation_kwargs: sampling, as in
            ``GRPOConfig``.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        host: str = "0.0.0.0",
        port: int = 8000,
        group_port: int = 51216,
        connection_timeout: float = 240.0,
        eos_token_ids: list[int],
        device: torch.device | str | int | None = None,
        stage_device: str = "cpu",
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = 0,
        min_p: float | None = 0.0,
        repetition_penalty: float = 1.0,
        max_completion_length: int = 256,
        generation_kwargs: dict | None = None,
    ):
        require_vllm()  # TRL's client imports vLLM's NCCL helpers
        from trl.generation.vllm_client import VLLMClient

        self.base_url = base_url or f"http://{host}:{port}"
        wait_for_server(self.base_url, connection_timeout)
        self.client = VLLMClient(base_url=self.base_url, group_port=group_port, connection_timeout=connection_timeout)
        if device is not None:
            device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.device = device
        if device is not None:
            self.client.init_communicator(device=self.device)
        self.stage_device = stage_device
        self.eos_token_ids = list(eos_token_ids)
        self.sampling_kwargs = dict(
            repetition_penalty=repetition_penalty,
            temperature=temperature,
            top_p=top_p,
            top_k=0 if top_k is None else top_k,
            min_p=0.0 if min_p is None else min_p,
            max_tokens=max_completion_length,
            logprobs=0,
        )
        self.generation_kwargs = {"stop_token_ids": self.eos_token_ids, **(generation_kwargs or {})}
        self._unwrap = lambda model: model

    @classmethod
    def from_trainer(cls, trainer) -> VLLMServerEngine:
        """Main thread: connect to the server named by ``vllm_server_*`` and join its NCCL weight-update group."""
        args = trainer.args
        accelerator = trainer.accelerator
        if accelerator.num_processes != 1:
            raise NotImplementedError(
                "Server mode drives the vLLM server from one training process (the worker thread tags rollouts with "
                f"the version the server holds); got {accelerator.num_processes} processes."
            )
        if accelerator.device.type != "cuda":
            raise ValueError(
                "vllm_mode='server' pushes weights over NCCL, which needs the trainer on a CUDA device; got "
                f"{accelerator.device}. Use vllm_mode='colocate' (in-process engine) on this machine."
            )
        engine = cls(
            args.vllm_server_base_url,
            host=args.vllm_server_host,
            port=args.vllm_server_port,
            group_port=args.vllm_group_port,
            connection_timeout=args.vllm_server_timeout,
            eos_token_ids=trainer.eos_token_ids,
            device=accelerator.device,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            max_completion_length=args.max_completion_length,
            generation_kwargs=args.generation_kwargs,
        )
        engine._unwrap = accelerator.unwrap_model
        engine.load_weights(engine.stage_weights(trainer.model))  # version 0 = the trainer's weights
        return engine

    def generate(self, prompt_ids: list[list[int]], num_generations: int) -> EngineOutput:
        """``P`` prompts → ``P * num_generations`` completions (prompt-major) with the server's log-probs."""
        out = self.client.generate(
            prompts=[list(ids) for ids in prompt_ids],
            n=num_generations,
            generation_kwargs=self.generation_kwargs,
            **self.sampling_kwargs,
        )
        completion_ids = [list(ids) for ids in out["completion_ids"]]  # (P*G, ragged)
        logprobs = []  # (P*G, ragged): the sampled token's entry among the returned ones
        for ids, steps, step_ids in zip(completion_ids, out["logprobs"], out["logprob_token_ids"]):
            logprobs.append([step[candidates.index(token)] for token, step, candidates in zip(ids, steps, step_ids)])
        return EngineOutput(completion_ids=completion_ids, logprobs=logprobs)

    def stage_weights(self, model) -> StagedWeights:
        """Main thread: snapshot the (LoRA-merged) weights under checkpoint names, on ``stage_device``."""
        model = self._unwrap(model)
        tensors, numel = deque(), 0
        with torch.no_grad():
            for name, tensor in base_named_parameters(model):
                staged = tensor.to(self.stage_device, copy=True).contiguous()
                tensors.append((name, staged))
                numel += staged.numel()
        return StagedWeights(tensors, numel)

    def load_weights(self, update: StagedWeights) -> None:
        """Worker thread: stream the snapshot over NCCL (one tensor at a time on the GPU), then reset the cache."""
        if self.device is None:
            raise RuntimeError("This VLLMServerEngine was built without a CUDA device, so it cannot push weights.")
        torch.cuda.set_device(self.device)  # the current device is per thread
        metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in update.tensors]

        def stream():
            while update.tensors:
                name, tensor = update.tensors.popleft()
                yield name, tensor.to(self.device, non_blocking=True)

        self.client.update_named_params(metadata, stream())
        self.client.reset_prefix_cache()

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close_communicator()
            self.client = None


__all__ = ["VLLMServerEngine", "wait_for_server"]
