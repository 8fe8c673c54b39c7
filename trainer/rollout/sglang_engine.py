"""The SGLang rollout engine: `rollout.engine=sglang` (docs/engines.md).

`SGLangEngine` implements the `RolloutEngine` interface of engines.py on top of SGLang's offline
`sglang.Engine`, one engine per `RolloutWorker` Ray actor, like `VLLMEngine`. SGLang is imported only in
here, when an engine is built, so the trainer imports without it. Pinned to one SGLang release
(`SGLANG_VERSION`): its offline-engine methods and server arguments change between releases, and
tests/rollout/test_sglang_adapter.py checks every name used here against that release's own classes.

SGLang runs on GPUs only (its CPU backend is not a drop-in for the CUDA build cloudrl would install), so
this module has not run a generation on this project's CPU CI. What maps to what:

- Sampling: the same `SamplingSettings` keys as vLLM (`n` as n consecutive copies of each prompt, so
  prompt i's samples are results[i*n:(i+1)*n]; greedy as temperature 0; top_k -1 = off; stop strings kept
  in the output with `no_stop_trim`, as vLLM's `include_stop_str_in_output`), one sampler seed per row
  derived from the call's seed and the engine's index (`call_seed`).
- Log-probs: `return_logprob` gives each output token's log-prob after temperature scaling (SGLang's
  default unless SGLANG_RETURN_ORIGINAL_LOGPROB is set), like the trainer's recomputation.
- Finish reasons: SGLang's `meta_info.finish_reason.type` "length" is cloudrl's `length`, every other
  ("stop": end-of-sequence, stop token or stop string) is `stop`.
- Weights: `load_weights` (the object-store path) hands the tensors to `update_weights_from_tensor`;
  the NCCL path is SGLang's own: `init_weights_update_group` (rank offset, world size: weight_sync.group_ranks)
  and `update_weights_from_distributed` (names, dtypes, shapes broadcast by the trainer's rank 0, whose side
  is weight_sync.SGLangTransfer). SGLang answers both with (success, message): a failure raises here.
- Sleep: with `enable_memory_saver`, `release_memory_occupation` frees weights, KV cache and CUDA graphs;
  `resume_memory_occupation(tags=...)` brings the weights back first and the KV cache after the push,
  in the colocated order of vllm_engine.py.
- Several nodes: one engine's `nnodes`, `node_rank` and `dist_init_addr` are built by `engine_args`, but
  starting the engine's processes on its other nodes is not wired yet: config checks refuse
  rollout.engine=sglang with rollout.nodes_per_engine > 1.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Iterable

import torch

from ..config import ConfigError
from .engines import Completion, SamplingSettings, SleepingEngine
from .vllm_engine import call_seed, engines_sleep

SGLANG_VERSION = "0.5.23"
INSTALL_HINT = (
    f"rollout.engine=sglang needs SGLang on GPU nodes: pip install 'cloudrl[sglang]' (sglang=={SGLANG_VERSION})"
)
WEIGHT_GROUP = "cloudrl_weight_sync"
"""The name of the NCCL group SGLang's workers join for weight updates."""
MEMORY_TAGS = {"weights": ["weights"], "kv_cache": ["kv_cache", "cuda_graph"]}
"""SGLang's memory-saver tags (sglang.srt.constants) behind cloudrl's two wake steps."""


def check_sglang_available() -> str:
    """Raise ConfigError unless the pinned SGLang is installed here; return its version. Reads the
    package metadata only, so the driver can call it before any actor starts."""
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError(INSTALL_HINT)
    version = importlib.metadata.version("sglang")
    if version != SGLANG_VERSION:
        raise ConfigError(
            f"rollout.engine=sglang is tested with sglang=={SGLANG_VERSION} only (found {version}): "
            f"pip install 'sglang=={SGLANG_VERSION}'"
        )
    return version


def engine_args(cfg, model_path: str, engine_index: int = 0, node_rank: int = 0, dist_init_addr: str = "") -> dict:
    """The `sglang.Engine` keyword arguments (fields of SGLang's `ServerArgs`) for engine `engine_index`.

    A pure function of its arguments. `node_rank` and `dist_init_addr` (host:port of node rank 0) matter
    only for an engine over several nodes (rollout.nodes_per_engine)."""
    r = cfg.rollout
    response_tokens = cfg.response_limit  # multi-turn: the whole episode's response is fed back as prompt
    kwargs: dict = dict(
        model_path=model_path,
        tokenizer_path=model_path,
        trust_remote_code=cfg.model.trust_remote_code,
        dtype=cfg.model.dtype,
        random_seed=cfg.trainer.seed + engine_index,
        context_length=cfg.data.max_prompt_length + response_tokens,
        tp_size=r.tensor_parallel_size,
        pp_size=r.pipeline_parallel_size,
        mem_fraction_static=r.gpu_memory_utilization,
        # Sleep mode: weights and KV cache allocated through SGLang's releasable memory pool.
        enable_memory_saver=engines_sleep(cfg),
        # The engine's GPUs are the ones Ray made visible to its actor.
        base_gpu_id=0,
        log_level="error",
    )
    if r.nodes_per_engine > 1:
        kwargs.update(nnodes=r.nodes_per_engine, node_rank=node_rank, dist_init_addr=dist_init_addr)
    return kwargs


def sampling_params(settings: SamplingSettings) -> dict:
    """SGLang's per-request sampling parameters (fields of its `SamplingParams`) for one sample."""
    greedy = settings.greedy
    return dict(
        max_new_tokens=settings.max_new_tokens,
        temperature=0.0 if greedy else settings.temperature,
        top_p=1.0 if greedy else settings.top_p,
        top_k=settings.top_k if not greedy and settings.top_k > 0 else -1,
        stop=list(settings.stop) or None,
        # The stop string's tokens were sampled: keep them, with their log-probs, as the other engines do.
        no_stop_trim=True,
    )


def request_batch(prompts: list[list[int]], settings: SamplingSettings, engine_index: int) -> tuple[list, list]:
    """`Engine.generate`'s input_ids and sampling_params: each prompt `n` times in a row (the result order
    is then the request order), each row with its own seed unless greedy."""
    rows = [list(p) for p in prompts for _ in range(settings.n)]
    base = sampling_params(settings)
    params = []
    for i in range(len(rows)):
        row = dict(base)
        if not settings.greedy:
            row["sampling_seed"] = (call_seed(settings.seed, engine_index) + i) % 2**63
        params.append(row)
    return rows, params


def completion(output: dict) -> Completion:
    """One of `Engine.generate`'s results (a dict) as a Completion."""
    token_ids = list(output["output_ids"])
    meta = output["meta_info"]
    logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"SGLang returned {len(logprobs)} log-probs for {len(token_ids)} tokens")
    reason = meta.get("finish_reason") or {}
    return Completion(token_ids, logprobs, "length" if reason.get("type") == "length" else "stop")


def _check(what: str, result) -> None:
    """SGLang's weight-update calls report failure as (False, message) instead of raising."""
    if isinstance(result, tuple) and result and not result[0]:
        raise RuntimeError(f"SGLang could not {what}: {result[1] if len(result) > 1 else 'no reason given'}")


class SGLangEngine(SleepingEngine):
    """Generation with SGLang's offline engine; weights updated in memory. One engine per RolloutWorker
    actor (`engine_index`: its rank among the engines). Sleeps only with the memory saver
    (rollout.sleep_between_rollouts, placement.colocate_all)."""

    name = "SGLang"

    def __init__(self, model_path: str, cfg, engine_index: int = 0):
        check_sglang_available()
        if not torch.cuda.is_available():
            raise ConfigError(
                "rollout.engine=sglang runs on GPUs only: give the engines GPUs, or use rollout.engine=vllm"
            )
        try:
            import sglang
        except ImportError as exc:  # installed but broken, e.g. a missing dependency
            raise ConfigError(f"{INSTALL_HINT}; importing sglang failed: {exc}") from None
        self.engine_index = engine_index
        self.sleeps = engines_sleep(cfg)
        self.engine = sglang.Engine(**engine_args(cfg, model_path, engine_index))

    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[Completion]:
        self.check_awake()
        rows, params = request_batch(prompts, settings, self.engine_index)
        outputs = self.engine.generate(input_ids=rows, sampling_params=params, return_logprob=True)
        return [completion(out) for out in outputs]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """New policy weights (Hugging Face names, full tensors) into the engine; SGLang maps the names and
        flushes its prefix cache, whose keys and values came from the old weights."""
        self.engine.update_weights_from_tensor(named_tensors=list(named_tensors), flush_cache=True)
        self.stale = False

    # The NCCL path (weight_sync.py): the trainer's rank 0 broadcasts, the engine's workers receive.
    def init_weight_transfer(self, init_info: dict) -> None:
        _check(
            "join the weight-update group",
            self.engine.init_weights_update_group(
                master_address=init_info["master_address"],
                master_port=init_info["master_port"],
                rank_offset=init_info["rank_offset"],
                world_size=init_info["world_size"],
                group_name=WEIGHT_GROUP,
                backend="nccl",
            ),
        )

    def start_weight_update(self) -> None:
        pass  # SGLang pauses nothing: each update call is one complete transfer

    def update_weights(self, update_info: dict) -> None:
        _check(
            "receive the broadcast weights",
            self.engine.update_weights_from_distributed(
                names=list(update_info["names"]),
                dtypes=[str(d).removeprefix("torch.") for d in update_info["dtypes"]],
                shapes=[list(s) for s in update_info["shapes"]],
                group_name=WEIGHT_GROUP,
                flush_cache=bool(update_info.get("flush_cache", True)),  # once, after the last bucket
            ),
        )

    def finish_weight_update(self) -> None:
        self.stale = False

    # Sleep (SleepingEngine): the memory saver releases every tag at once, and each wake step resumes its tags.
    @property
    def can_sleep(self) -> bool:
        return self.sleeps

    def _release(self) -> None:
        self.engine.release_memory_occupation()

    def _resume(self, step: str) -> None:
        self.engine.resume_memory_occupation(tags=MEMORY_TAGS[step])
