"""The multi-turn search loop with a scripted policy (no model), the loss mask it produces, and the GAE
convention on responses with observation gaps. Fast; no cluster."""

from __future__ import annotations

import pickle

import pytest
import torch
from cloudrl.trainer.algo import ppo_math as pm
from cloudrl.trainer.algo.advantages import compute_advantages
from cloudrl.trainer.algo.batch import build_batch
from cloudrl.trainer.config import load_config
from cloudrl.trainer.inputs.demo import build_char_tokenizer
from cloudrl.trainer.rollout.engines import Completion, Completions, SamplingSettings
from cloudrl.trainer.rollout.environment import EpisodeLimits
from cloudrl.trainer.rollout.multiturn import (
    INFO_CLOSE,
    INFO_OPEN,
    INVALID_CALL,
    SEARCH_EPISODE_S,
    TurnLoop,
    format_passages,
    search_call,
    turn_metrics,
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


class ScriptedPolicy:
    """An engine whose every turn is scripted per prompt: turn k of a sample is script[k]. It stops
    like the engines do: after the first stop string, at EOS (`<eos>` in the script) or at
    max_new_tokens. Log-probs are -1 on every sampled token, so observation tokens stand out."""

    def __init__(self, tok, scripts: dict[str, list[str]]):
        self.tok, self.scripts, self.calls = tok, scripts, []

    def generate(self, contexts, settings):
        self.calls.append((len(contexts), settings))
        out = []
        for ctx in contexts:
            text = self.tok.decode(ctx, skip_special_tokens=True)
            prompt = text.split("|")[0] + "|"
            turn = text.count(INFO_OPEN.strip())
            for _ in range(settings.n):
                out.append(self._turn(self.scripts[prompt][turn], settings))
        return out

    def _turn(self, script: str, settings) -> Completion:
        eos = script.endswith("<eos>")
        text = script.removesuffix("<eos>")
        cuts = [text.find(s) + len(s) for s in settings.stop if s in text]
        stopped = bool(cuts) or eos
        text = text[: min(cuts)] if cuts else text
        ids = self.tok.encode(text, add_special_tokens=False) + ([self.tok.eos_token_id] if eos and not cuts else [])
        reason = "stop" if stopped and len(ids) <= settings.max_new_tokens else "length"
        ids = ids[: settings.max_new_tokens]
        return Completion(ids, [-1.0] * len(ids), reason)


class FakeRetriever:
    """Stands in for the HTTP retriever (tested in test_search_retriever.py): records each batch."""

    def __init__(self, passages=("Paris is the capital of France.",)):
        self.batches, self.passages = [], list(passages)

    def __call__(self, queries):
        self.batches.append(list(queries))
        return [[f"{p} ({q})" for p in self.passages] for q in queries]


LIMITS = EpisodeLimits(5, 400, 128, SEARCH_EPISODE_S)


def _run(
    tok,
    scripts,
    limits=LIMITS,
    n=1,
    max_new_tokens=64,
    retriever=None,
):
    policy, retriever = ScriptedPolicy(tok, scripts), retriever or FakeRetriever()
    loop = TurnLoop(policy.generate, tok, retriever, limits)
    prompts = [tok.encode(p, add_special_tokens=False) for p in scripts]
    out = loop.run(prompts, SamplingSettings(n=n, max_new_tokens=max_new_tokens))
    return out, policy, retriever, loop


def _text(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def test_observation_appended_and_masked(tok):
    out, policy, retriever, _ = _run(tok, {"Q1|": ["<search>capital</search>", "<answer>Paris</answer>"]})
    (c,) = out
    obs = INFO_OPEN + format_passages(["Paris is the capital of France. (capital)"]) + INFO_CLOSE
    assert _text(tok, c.token_ids) == "<search>capital</search>" + obs + "<answer>Paris</answer>"
    first = len("<search>capital</search>")
    n_obs = len(tok.encode(obs, add_special_tokens=False))
    assert c.loss_mask == [1] * first + [0] * n_obs + [1] * len("<answer>Paris</answer>")
    assert [lp for lp, m in zip(c.logprobs, c.loss_mask) if not m] == [0.0] * n_obs
    assert all(lp == -1.0 for lp, m in zip(c.logprobs, c.loss_mask) if m)
    assert c.turns == dict(turns=2, searches=1, invalid_calls=0, observation_tokens=n_obs)
    assert c.finish_reason == "stop"
    assert retriever.batches == [["capital"]]
    # the engine always stops at the closing tags, whatever rollout.stop holds
    assert {"</search>", "</answer>"} <= set(policy.calls[0][1].stop)


def test_batched_samples_finish_at_different_turns(tok):
    scripts = {
        "A|": ["<answer>1</answer>"],
        "B|": ["<search>b1</search>", "<search>b2</search>", "<answer>2</answer>"],
        "C|": ["<search>c1</search>", "<answer>3</answer>"],
    }
    out, policy, retriever, _ = _run(tok, scripts, n=2)
    assert [c.turns["turns"] for c in out] == [1, 1, 3, 3, 2, 2]  # grouped per prompt, n=2 each
    # one engine call and one retriever request per turn, holding only the samples still running
    assert [size for size, _ in policy.calls] == [3, 4, 2]
    assert [s.n for _, s in policy.calls] == [2, 1, 1]
    assert retriever.batches == [["b1", "b1", "c1", "c1"], ["b2", "b2"]]
    assert all(_text(tok, c.token_ids).endswith("</answer>") for c in out)
    m = turn_metrics(out)
    assert m["search/turns_per_sample"] == pytest.approx(12 / 6)
    assert m["search/searches_per_sample"] == pytest.approx(6 / 6)
    assert m["search/valid_call_rate"] == 1.0
    assert m["search/observation_tokens"] == pytest.approx(sum(c.turns["observation_tokens"] for c in out) / 6)


def test_max_turns_leaves_the_last_call_unanswered(tok):
    out, policy, retriever, _ = _run(
        tok,
        {"L|": ["<search>again</search>"] * 10},
        limits=EpisodeLimits(3, 1000, 64, SEARCH_EPISODE_S),
    )
    (c,) = out
    assert c.turns["searches"] == 2 and c.turns["turns"] == 3
    assert len(retriever.batches) == 2
    assert _text(tok, c.token_ids).endswith("</information>\n<search>again</search>")
    assert c.loss_mask[-len("<search>again</search>") :] == [1] * len("<search>again</search>")


def test_length_budget_is_never_exceeded(tok):
    budget = 90
    out, policy, _, _ = _run(
        tok,
        {"L|": ["<search>q</search>", "x" * 200]},
        limits=EpisodeLimits(5, budget, 40, SEARCH_EPISODE_S),
    )
    (c,) = out
    assert len(c.token_ids) == budget and c.finish_reason == "length"
    assert c.turns["searches"] == 1
    assert policy.calls[1][1].max_new_tokens == budget - len(c.token_ids[: c.loss_mask.index(0)]) - 40
    # no room for an observation plus one more token: the sample ends after its call instead
    out, _, retriever, _ = _run(
        tok,
        {"S|": ["<search>q</search>", "<answer>a</answer>"]},
        limits=EpisodeLimits(5, 40, 32, SEARCH_EPISODE_S),
    )
    (c,) = out
    assert _text(tok, c.token_ids) == "<search>q</search>" and c.finish_reason == "length"
    assert 0 not in c.loss_mask and c.turns["searches"] == 0  # asked, but never answered


def test_invalid_calls_get_an_error_observation(tok):
    scripts = {"I|": ["query</search>", "<search> </search>", "<search>ok</search>", "<answer>x</answer>"]}
    out, _, retriever, _ = _run(tok, scripts)
    (c,) = out
    assert c.turns == dict(turns=4, searches=1, invalid_calls=2, observation_tokens=c.turns["observation_tokens"])
    assert _text(tok, c.token_ids).count(INVALID_CALL) == 2
    assert retriever.batches == [["ok"]]  # invalid calls never reach the retriever
    assert turn_metrics(out)["search/valid_call_rate"] == pytest.approx(1 / 3)


def test_eos_and_unclosed_turns_end_the_sample(tok):
    out, _, retriever, _ = _run(tok, {"E|": ["I give up<eos>"], "U|": ["<search>never closed"]}, max_new_tokens=10)
    assert [c.finish_reason for c in out] == ["stop", "length"]
    assert out[0].token_ids[-1] == tok.eos_token_id
    assert retriever.batches == [] and all(c.turns["turns"] == 1 for c in out)


def test_observation_cut_to_max_obs_tokens(tok):
    out, _, _, loop = _run(
        tok,
        {"C|": ["<search>q</search>", "<answer>a</answer>"]},
        limits=EpisodeLimits(2, 400, 50, SEARCH_EPISODE_S),
        retriever=FakeRetriever(["long " * 100]),
    )
    (c,) = out
    assert c.turns["observation_tokens"] == 50
    assert _text(tok, c.token_ids).endswith(INFO_CLOSE + "<answer>a</answer>")


def test_search_call_parsing():
    assert search_call("think <search> who wrote it </search>") == "who wrote it"
    assert search_call("<search>a</search><search>b</search>") == "b"
    assert search_call("<search>q</search>.") == "q"  # a subword token may run past the tag
    assert search_call("<search></search>") is None and search_call("q</search>") is None
    assert search_call("<search>" + "x" * 600 + "</search>") is None


def test_completions_cross_processes_with_their_masks():
    cs = Completions(
        [Completion([1, 2, 3], [-1.0, 0.0, -1.0], "stop", [1, 0, 1], {"turns": 2}), Completion([4], [-0.5], "length")]
    )
    back = pickle.loads(pickle.dumps(cs))
    assert back == cs
    assert back[0].loss_mask == [1, 0, 1] and back[1].loss_mask is None


def test_build_batch_loss_mask_has_gaps_inside_the_response_mask():
    batch = build_batch([[5, 6], [7]], [[1, 2, 3, 4], [8]], 0, [[-1.0] * 4, [-1.0]], [[1, 0, 0, 1], None])
    assert batch["response_mask"].tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[1, 0, 0, 1], [1, 0, 0, 0]]
    assert "loss_mask" not in build_batch([[5]], [[1]], 0, None, [None])


def _gae_reference(rewards, values, span, gamma, lam):
    """The GAE of verl's Search-R1 trainer, written out: over the whole response (observation tokens
    included, with the critic's values there), then whitened over that same response."""
    T = rewards.shape[1]
    adv, last = torch.zeros_like(rewards), torch.zeros(rewards.shape[0])
    for t in reversed(range(T)):
        nxt = values[:, t + 1] if t < T - 1 else torch.zeros(rewards.shape[0])
        last = rewards[:, t] + gamma * nxt - values[:, t] + gamma * lam * last
        adv[:, t] = last
    return pm.masked_whiten(adv, span), adv + values


def test_gae_flows_across_observation_gaps_as_in_search_r1():
    torch.manual_seed(0)
    span = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]]).float()
    gen = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 1, 0, 1]]).float()
    values = torch.randn(2, 7) * span
    old_lp, ref_lp = torch.randn(2, 7), torch.randn(2, 7)
    scores = torch.tensor([1.0, 0.0])
    cfg = load_config(
        "local", ["algorithm.name=ppo", "algorithm.gamma=0.9", "algorithm.lam=0.8", "algorithm.kl_coef=0.1"]
    )
    batch = {
        "response_mask": span,
        "loss_mask": gen,
        "values": values.clone(),
        "old_logprobs": old_lp,
        "ref_logprobs": ref_lp,
        "engine_logprobs": old_lp,
    }
    metrics = compute_advantages(cfg, batch, scores, 0.1)

    # the KL penalty only on generated tokens; the score on the response's last token
    kl = pm.kl_estimate(old_lp, ref_lp, cfg.algorithm.kl_estimator) * gen
    rewards = pm.token_level_rewards(scores, span, kl, 0.1)
    want_adv, want_ret = _gae_reference(rewards * span, values, span, 0.9, 0.8)
    assert torch.allclose(batch["advantages"], want_adv * span, atol=1e-5)
    assert torch.allclose(batch["returns"], want_ret * span, atol=1e-5)
    assert metrics["actor/kl"] == pytest.approx(float(pm.masked_mean(kl, gen)), rel=1e-5)
    # the values at observation tokens shape the advantage of the generated token before them
    values2 = values.clone()
    values2[0, 2] += 1.0
    batch2 = dict(batch, values=values2)
    compute_advantages(cfg, batch2, scores, 0.1)
    assert not torch.isclose(batch2["advantages"][0, 1], batch["advantages"][0, 1])
