"""The Search-R1 preset, its exact-match reward, and the local search task's data. Fast; no cluster."""

from __future__ import annotations

import json

import pytest

from cloudrl.trainer.config import load_config
from cloudrl.trainer.errors import ConfigError
from cloudrl.trainer.rewards import answer_em, resolve_reward_fn
from cloudrl.trainer.search_task import _example, fact_text, make_facts, write_task


def test_answer_em_reads_the_last_answer_and_normalises():
    completions = ["<search>x</search><answer> The Eiffel Tower! </answer>",
                   "<answer>no</answer> then <answer>Paris</answer>",
                   "Paris",                       # no answer tags: no reward
                   "<answer>Lyon</answer>",
                   "<answer>1912</answer>"]
    truths = ["eiffel tower", json.dumps(["paris", "Paris, France"]), "Paris", "Paris",
              json.dumps({"target": ["1912"]})]  # Search-R1's own ground-truth layout
    assert answer_em(completions, truths) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert resolve_reward_fn("answer_em") is answer_em


def test_search_r1_preset_matches_the_guide():
    cfg = load_config("search-r1")
    assert cfg.search.enabled and cfg.search.url == "http://127.0.0.1:8000/retrieve"
    assert (cfg.search.max_turns, cfg.search.topk, cfg.algorithm.kl_coef) == (4, 3, 0.001)
    assert cfg.algorithm.name == "ppo" and cfg.reward.function == "answer_em"


@pytest.mark.parametrize("override, words", [
    ("search.max_obs_tokens=8", "search.max_obs_tokens"),
    ("search.topk=0", "search.topk"),
    ("placement.rollout_in_actor=true", "search.enabled=true runs its turns in rollout workers"),
])
def test_bad_search_settings_are_one_line(override, words):
    with pytest.raises(ConfigError, match=words):
        load_config("local", ["search.enabled=true", override])


def test_the_local_task_answers_only_through_search(tmp_path):
    paths = write_task(tmp_path, size=20, seed=3)
    prompts = [json.loads(line) for line in paths["prompts"].read_text().splitlines()]
    corpus = [json.loads(line)["contents"] for line in paths["corpus"].read_text().splitlines()]
    assert len(prompts) == len(corpus) == 20 == len({p["prompt"] for p in prompts})
    for p, (name, code) in zip(prompts, make_facts(20, 3)):
        assert p == {"prompt": f"{name}?", "answer": str(code)}
        assert fact_text(name, code) in corpus and p["answer"] not in p["prompt"]


def test_the_warm_up_reads_observations_but_does_not_learn_them():
    import random

    from cloudrl.trainer.demo import build_char_tokenizer

    tok = build_char_tokenizer()
    ids, labels = _example(tok, "zabo", 7, True, random.Random(0))
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == "zabo?<search>zabo</search>\n<information>Doc 1: zabo code is 7\n</information>\n<answer>7</answer>"
    learned = tok.decode([t for t, lab in zip(ids, labels) if lab != -100], skip_special_tokens=True)
    assert learned == "<search>zabo</search><answer>7</answer>"  # the observation is context, never a target
    ids, _ = _example(tok, "zabo", 7, False, random.Random(0))
    assert tok.decode(ids, skip_special_tokens=True).startswith("zabo?<answer>")
