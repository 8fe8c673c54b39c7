"""The Search-R1 preset, its exact-match reward, the local search task's data and warm-up, and (on a
real local Ray instance) the policy learning to search on that task."""

from __future__ import annotations

import json
import random

import pytest
from cloudrl.trainer.agents.search_task import (
    _example,
    fact_text,
    make_facts,
    rl_overrides,
    warm_up_model,
    warm_up_rows,
    write_task,
)
from cloudrl.trainer.config import load_config
from cloudrl.trainer.errors import ConfigError
from cloudrl.trainer.inputs.demo import WarmUp
from cloudrl.trainer.inputs.rewards import answer_em, resolve_reward_fn
from runs import serving_retriever, step_metrics, tiny_overrides


def test_answer_em_reads_the_last_answer_and_normalises():
    completions = [
        "<search>x</search><answer> The Eiffel Tower! </answer>",
        "<answer>no</answer> then <answer>Paris</answer>",
        "Paris",  # no answer tags: no reward
        "<answer>Lyon</answer>",
        "<answer>1912</answer>",
    ]
    truths = [
        "eiffel tower",
        json.dumps(["paris", "Paris, France"]),
        "Paris",
        "Paris",
        json.dumps({"target": ["1912"]}),
    ]  # Search-R1's own ground-truth layout
    assert answer_em(completions, truths) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert resolve_reward_fn("answer_em") is answer_em


def test_search_r1_preset_matches_the_guide():
    cfg = load_config("search-r1")
    assert cfg.search.enabled and cfg.search.url == "http://127.0.0.1:8000/retrieve"
    assert (cfg.rollout.max_turns - 1, cfg.search.topk, cfg.algorithm.kl_coef) == (4, 3, 0.001)  # 4 searches answered
    assert cfg.algorithm.name == "ppo" and cfg.reward.function == "answer_em"


@pytest.mark.parametrize(
    "override, words",
    [
        ("rollout.max_obs_tokens=8", "rollout.max_obs_tokens=8 leaves a search observation no room"),
        ("search.topk=0", "search.topk"),
        ("placement.rollout_in_actor=true", "search.enabled=true runs its turns in rollout workers"),
    ],
)
def test_bad_search_settings_are_one_line(override, words):
    with pytest.raises(ConfigError, match=words):
        load_config("local", ["search.enabled=true", override])


def test_the_local_task_answers_only_through_search(tmp_path):
    paths = write_task(tmp_path, size=20, val_size=5, seed=3)
    prompts, val = ([json.loads(line) for line in paths[k].read_text().splitlines()] for k in ("prompts", "val"))
    corpus = [json.loads(line)["contents"] for line in paths["corpus"].read_text().splitlines()]
    assert (len(prompts), len(val), len(corpus)) == (20, 5, 25)
    assert len({p["prompt"] for p in prompts + val}) == 25  # validation asks about names training never does
    for p, (name, code) in zip(prompts + val, make_facts(25, 3)):
        assert p == {"prompt": f"{name}?", "answer": str(code)}
        assert fact_text(name, code) in corpus and p["answer"] not in p["prompt"]


def test_the_warm_up_reads_observations_but_does_not_learn_them():
    from cloudrl.trainer.inputs.demo import build_char_tokenizer

    tok = build_char_tokenizer()
    ids, labels = _example(tok, "zabok", 7, True, random.Random(0))
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == (
        "zabok?<search>zabok</search>\n<information>Doc 1: zabok code is 7\n</information>\n<answer>7</answer>"
    )
    learned = tok.decode([t for t, lab in zip(ids, labels) if lab != -100], skip_special_tokens=True)
    assert learned == "<search>zabok</search><answer>7</answer>"  # the observation is context, never a target
    ids, labels = _example(tok, "zabok", 7, True, random.Random(0), learn_choice=False)
    learned = tok.decode([t for t, lab in zip(ids, labels) if lab != -100], skip_special_tokens=True)
    assert learned == "<earch>zabok</search><answer>7</answer>"  # the choice to search is not taught here
    ids, _ = _example(tok, "zabok", 7, False, random.Random(0))
    assert tok.decode(ids, skip_special_tokens=True).startswith("zabok?<answer>")


def test_the_warm_up_uses_fresh_names_and_teaches_the_choice_at_its_share():
    from cloudrl.trainer.inputs.demo import build_char_tokenizer

    tok = build_char_tokenizer()
    task = {name for name, _ in make_facts(2000, 0)}
    rows = warm_up_rows(tok, random.Random(0), 4000, 0.2, task)
    texts = [tok.decode(ids, skip_special_tokens=True) for ids, _ in rows]
    names = {text.split("?")[0] for text in texts}
    assert len(names) > 3500 and not names & task
    choices = [tok.convert_ids_to_tokens(lab[7]) for _, lab in rows if lab[7] != -100]  # the letter after `name?<`
    assert abs(choices.count("s") / len(choices) - 0.2) < 0.03


# A shorter warm-up than the bench's (it still copies and reads well enough for searching to pay) and
# 10 steps of 8 prompts: ~70 s on 2 cores. Seeds 0, 1 and 2 pass.
SEED, WARMUP_STEPS, STEPS = 0, 240, 10


@pytest.mark.ray
def test_the_policy_learns_to_search(ray_local, tmp_path):
    """A short warm-up and a few PPO steps on the task: the policy searches more and scores more at
    the end than at the start (the warm-up searches 1 time in 5; searching finds the code)."""
    pytest.importorskip("bm25s")
    from cloudrl.trainer.driver import train

    paths = write_task(tmp_path / "task", size=1000, val_size=32, seed=SEED)
    facts = make_facts(1032, SEED)
    model = warm_up_model(tmp_path / "model", {name for name, _ in facts}, WarmUp(steps=WARMUP_STEPS, seed=SEED))
    with serving_retriever(paths["corpus"], tmp_path / "index", topk=1) as url:
        overrides = tiny_overrides(tmp_path / "run") + rl_overrides(paths["prompts"], paths["val"], url, model)
        train(
            load_config(
                "local",
                overrides
                + [
                    f"trainer.total_steps={STEPS}",
                    "data.train_batch_size=8",
                    "data.val_batch_size=32",
                    "actor.mini_batch_size=64",
                    "actor.micro_batch_size=64",
                    "critic.mini_batch_size=64",
                    "critic.micro_batch_size=64",
                    "trainer.export_hf=false",
                    f"trainer.seed={SEED}",
                ],
            )
        )
    steps = step_metrics(tmp_path / "run")
    mean = lambda block, key: sum(r[key] for r in block) / len(block)  # noqa: E731
    first, last = steps[:3], steps[-3:]
    trace = [(round(r["rollout/reward_mean"], 2), round(r["search/searches_per_sample"], 2)) for r in steps]
    assert mean(last, "search/searches_per_sample") > mean(first, "search/searches_per_sample") + 0.25, trace
    assert mean(last, "rollout/reward_mean") > mean(first, "rollout/reward_mean") + 0.25, trace
