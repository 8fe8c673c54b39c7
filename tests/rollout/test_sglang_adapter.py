"""The SGLang adapter (trainer/rollout/sglang_engine.py) without a GPU.

The first half runs everywhere: what the adapter sends for a `generate` call (each prompt n times in a row,
greedy, top-k off, stop strings kept, a seed per row), how it reads SGLang's results (log-probs, finish
reasons), and the order of its weight and memory calls, against a stand-in engine. The second half checks
every name the adapter passes against the pinned SGLang's own classes (`ServerArgs`, `SamplingParams`,
`Engine`'s method signatures, its memory tags and finish reasons); it needs SGLang importable and skips
otherwise. SGLang is not in the CI venv: sglang==0.5.23 pins a CUDA build of torch (torch==2.14.1), so
installing it there would replace the CPU torch. With `pip install --no-deps sglang==0.5.23` plus its
pure-Python imports (orjson, IPython, gguf, torchvision) in a separate venv these classes import on CPU.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
from cloudrl.trainer.config import load_config
from cloudrl.trainer.rollout import sglang_engine
from cloudrl.trainer.rollout.engines import SamplingSettings


def config(*overrides: str):
    return load_config("sglang-2x8", list(overrides))


def settings(**kw) -> SamplingSettings:
    return SamplingSettings(**{"n": 2, "max_new_tokens": 5, "temperature": 0.7, "top_k": -1, "seed": 3, **kw})


def test_each_prompt_is_sent_n_times_in_a_row_with_its_own_seed():
    rows, params = sglang_engine.request_batch([[1, 2], [3]], settings(stop=["\n\n"]), engine_index=1)
    assert rows == [[1, 2], [1, 2], [3], [3]]
    seeds = [p.pop("sampling_seed") for p in params]
    assert len(set(seeds)) == 4
    assert params[0] == dict(max_new_tokens=5, temperature=0.7, top_p=1.0, top_k=-1, stop=["\n\n"], no_stop_trim=True)
    other_engine = [p["sampling_seed"] for p in sglang_engine.request_batch([[1, 2], [3]], settings(), 2)[1]]
    assert set(other_engine).isdisjoint(seeds)


def test_greedy_is_temperature_zero_without_seeds():
    _, params = sglang_engine.request_batch([[1]], settings(greedy=True, n=1, top_k=20), 0)
    assert params == [dict(max_new_tokens=5, temperature=0.0, top_p=1.0, top_k=-1, stop=None, no_stop_trim=True)]


def test_results_become_completions():
    out = {
        "output_ids": [5, 6],
        "meta_info": {"output_token_logprobs": [(-0.1, 5, None), (-0.2, 6, None)], "finish_reason": {"type": "length"}},
    }
    done = sglang_engine.completion(out)
    assert (done.token_ids, done.logprobs, done.finish_reason) == ([5, 6], [-0.1, -0.2], "length")
    out["meta_info"]["finish_reason"] = {"type": "stop", "matched": "\n\n"}
    assert sglang_engine.completion(out).finish_reason == "stop"
    out["meta_info"]["output_token_logprobs"] = out["meta_info"]["output_token_logprobs"][:1]
    with pytest.raises(RuntimeError, match="1 log-probs for 2 tokens"):
        sglang_engine.completion(out)


def test_engine_args_follow_the_config():
    args = sglang_engine.engine_args(config(), "/m", engine_index=2)
    assert (args["tp_size"], args["pp_size"], args["mem_fraction_static"]) == (4, 1, 0.5)
    assert args["enable_memory_saver"] is True  # colocated: the engines sleep while the policy trains
    assert args["context_length"] == 1024 + 1024 and args["random_seed"] == config().trainer.seed + 2
    assert "nnodes" not in args
    episodes = config("data.max_prompt_length=64", "rollout.environment=env.py:Env", "rollout.max_episode_tokens=200")
    assert sglang_engine.engine_args(episodes, "/m")["context_length"] == 64 + 200  # the episode is fed back
    spanning = load_config("engine-2node", ["rollout.engine=vllm"])  # the keys exist for a two-node engine
    spanning.rollout.engine = "sglang"
    args = sglang_engine.engine_args(spanning, "/m", node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert (args["nnodes"], args["node_rank"], args["dist_init_addr"]) == (2, 1, "10.0.0.1:5000")


class FakeSGLang:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, kwargs))


def fake_engine(cfg) -> sglang_engine.SGLangEngine:
    engine = object.__new__(sglang_engine.SGLangEngine)
    engine.engine_index, engine.sleeps, engine._sleeping, engine.stale = (
        0,
        sglang_engine.engines_sleep(cfg),
        set(),
        False,
    )
    engine.engine = FakeSGLang()
    return engine


def test_sleep_and_the_colocated_wake_order():
    engine = fake_engine(config())
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[1]], settings())
    engine.wake_weights()
    engine.load_weights([("w", 1)])
    engine.wake_kv_cache()
    names = [(name, kw.get("tags")) for name, kw in engine.engine.calls]
    assert names == [
        ("release_memory_occupation", None),
        ("resume_memory_occupation", ["weights"]),
        ("update_weights_from_tensor", None),
        ("resume_memory_occupation", ["kv_cache", "cuda_graph"]),
    ]
    assert not engine.asleep and not engine.stale


def test_the_nccl_path_joins_sglangs_group_with_its_rank_offset():
    engine = fake_engine(config())
    engine.init_weight_transfer({"master_address": "h", "master_port": 1, "rank_offset": 5, "world_size": 9})
    engine.update_weights({"names": ["w"], "dtypes": ["torch.bfloat16"], "shapes": [(2, 3)]})
    (_, init), (_, update) = engine.engine.calls
    assert init["rank_offset"] == 5 and init["world_size"] == 9 and init["group_name"] == update["group_name"]
    assert update["dtypes"] == ["bfloat16"] and update["shapes"] == [[2, 3]]


# ------------------------------------------------------------------------------------------------
# Against SGLang's own classes
# ------------------------------------------------------------------------------------------------

needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="sglang is not installed here (its CUDA torch pin keeps it out of the CPU venv; see the module docstring)",
)


@pytest.fixture(scope="module")
def sgl():
    from sglang.srt import constants
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_STR
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    return dict(
        Engine=Engine,
        ServerArgs=ServerArgs,
        SamplingParams=SamplingParams,
        constants=constants,
        FINISH_LENGTH=FINISH_LENGTH,
        FINISH_MATCHED_STR=FINISH_MATCHED_STR,
    )


@needs_sglang
def test_the_pinned_version_is_the_one_installed():
    assert sglang_engine.check_sglang_available() == sglang_engine.SGLANG_VERSION


@needs_sglang
def test_engine_args_are_server_args_fields(sgl):
    fields = set(inspect.signature(sgl["ServerArgs"]).parameters)
    spanning = load_config("engine-2node", [])
    spanning.rollout.engine = "sglang"
    for cfg in (config(), spanning):
        args = sglang_engine.engine_args(cfg, "/m", node_rank=1, dist_init_addr="h:1")
        assert set(args) <= fields, set(args) - fields


class CharTokenizer:
    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


@needs_sglang
def test_sampling_params_are_sglangs(sgl):
    _, params = sglang_engine.request_batch([[1]], settings(stop=["x"]), 0)
    sp = sgl["SamplingParams"](**params[0])  # SGLang's own constructor accepts every key
    sp.normalize(CharTokenizer())  # the engine keeps its tokenizer: stop strings need it
    sp.verify(vocab_size=100)
    assert sp.no_stop_trim and sp.stop_strs == ["x"] and sp.sampling_seed == params[0]["sampling_seed"]
    _, greedy = sglang_engine.request_batch([[1]], settings(greedy=True), 0)
    gp = sgl["SamplingParams"](**greedy[0])
    assert gp.top_k == 1  # SGLang's greedy: temperature 0 becomes top_k=1


@needs_sglang
def test_engine_methods_take_the_arguments_passed(sgl):
    engine = sgl["Engine"]
    rows, params = sglang_engine.request_batch([[1]], settings(), 0)
    inspect.signature(engine.generate).bind(None, input_ids=rows, sampling_params=params, return_logprob=True)
    inspect.signature(engine.update_weights_from_tensor).bind(None, named_tensors=[], flush_cache=True)
    inspect.signature(engine.init_weights_update_group).bind(
        None, master_address="h", master_port=1, rank_offset=1, world_size=2, group_name="g", backend="nccl"
    )
    inspect.signature(engine.update_weights_from_distributed).bind(
        None, names=[], dtypes=[], shapes=[], group_name="g", flush_cache=True
    )
    inspect.signature(engine.release_memory_occupation).bind(None)
    inspect.signature(engine.resume_memory_occupation).bind(None, tags=["weights"])


@needs_sglang
def test_memory_tags_and_finish_reasons_are_sglangs(sgl):
    c = sgl["constants"]
    known = {c.GPU_MEMORY_TYPE_WEIGHTS, c.GPU_MEMORY_TYPE_KV_CACHE, c.GPU_MEMORY_TYPE_CUDA_GRAPH}
    assert {t for tags in sglang_engine.MEMORY_TAGS.values() for t in tags} == known
    assert sgl["FINISH_LENGTH"](length=5).to_json()["type"] == "length"
    assert sgl["FINISH_MATCHED_STR"](matched="x").to_json()["type"] == "stop"
