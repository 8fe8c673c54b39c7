"""rollout.partial: a batch generated in segments takes the weights pushed meanwhile and continues its unfinished
samples from their prefixes (rollout/partial.py). On the transformers engine with the tiny model: the tokens
before the switch carry the old version and the old weights' log-probs, the ones after it the new version and the
new weights' log-probs, and the continuation was asked for with the prefix, not generated again. Then through a
real RolloutWorker actor, a queue and a push made while the batch generates."""

from __future__ import annotations

import pytest
import torch
from cloudrl.trainer.config import ConfigError, load_config
from cloudrl.trainer.inputs.demo import build_char_tokenizer, build_tiny_model
from cloudrl.trainer.rollout.engines import Completion, HFEngine, SamplingSettings
from cloudrl.trainer.rollout.partial import WeightBoard, generate_in_segments, segment_tokens
from cloudrl.trainer.rollout.queue import staleness

SEGMENT = 4
SETTINGS = SamplingSettings(n=2, max_new_tokens=12, temperature=1.0, seed=0)


def _logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """The model's log-probability of each of `tokens` after `prompt` and the tokens before it."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).tolist()


def test_unfinished_samples_continue_from_their_prefix_with_the_new_weights():
    tok = build_char_tokenizer()
    old, new = build_tiny_model(tok, seed=0).eval(), build_tiny_model(tok, seed=1).eval()
    engine = HFEngine(build_tiny_model(tok, seed=0).eval(), tok)
    calls = []

    def recording(prompts, settings):
        calls.append((prompts, settings))
        return engine.generate(prompts, settings)

    def newer() -> int:  # the push arrives during the first segment
        if len(calls) == 1:
            engine.load_weights(new.named_parameters())
        return 1

    prompts = [tok.encode(p, add_special_tokens=False) for p in ("1+2=", "3+4=")]
    out = generate_in_segments(recording, prompts, SETTINGS, SEGMENT, 0, newer)

    assert len(out) == 4
    continued = [i for i, c in enumerate(out) if len(c.token_ids) > SEGMENT]
    assert continued, "no sample outlived its first segment: the test would prove nothing"
    first_prompts, first_settings = calls[0]
    assert first_prompts == prompts and first_settings.max_new_tokens == SEGMENT and first_settings.n == 2
    second_prompts, second_settings = calls[1]
    # resumed from the prefix: prompt + the first segment's tokens, one sample each
    assert second_prompts == [prompts[i // 2] + out[i].token_ids[:SEGMENT] for i in continued]
    assert second_settings.n == 1 and second_settings.seed != SETTINGS.seed
    for i, c in enumerate(out):
        prompt = prompts[i // 2]
        cut = min(SEGMENT, len(c.token_ids))
        assert c.versions == [0] * cut + [1] * (len(c.token_ids) - cut)
        assert len(c.token_ids) == 12 or c.finish_reason == "stop"
        before = _logprobs(old, prompt, c.token_ids, 1.0)[:cut]
        assert c.logprobs[:cut] == pytest.approx(before, abs=1e-4)  # the old weights' log-probs
        if i in continued:
            after = _logprobs(new, prompt, c.token_ids, 1.0)[cut:]
            assert c.logprobs[cut:] == pytest.approx(after, abs=1e-4)  # the new weights', on the whole prefix
            stale = _logprobs(old, prompt, c.token_ids, 1.0)[cut:]
            assert max(abs(a - b) for a, b in zip(c.logprobs[cut:], stale)) > 1e-2


def test_a_sample_that_stops_in_a_segment_or_across_two_is_not_continued():
    """Scripted engine: sample 0 ends with end-of-sequence in the first segment, sample 1 runs on, sample 2's
    stop string "ab" is split by the boundary ("a" | "b...")."""
    calls = []

    def generate(prompts, settings):
        calls.append(prompts)
        if len(calls) == 1:
            return [Completion([7, 2], [-1.0] * 2, "stop"), Completion([5, 5], [-1.0] * 2, "length")] + [
                Completion([3, ord("a")], [-1.0] * 2, "length")
            ]
        return [Completion([ord("b"), 9], [-2.0] * 2, "length") for _ in prompts]

    def stop_at(ids: list[int]) -> int | None:
        text = "".join(chr(i) if i > 31 else "_" for i in ids)
        return text.index("ab") + 2 if "ab" in text else None

    settings = SamplingSettings(n=3, max_new_tokens=4, seed=0)
    out = generate_in_segments(generate, [[1]], settings, 2, 5, lambda: 6, stop_at)
    assert calls == [[[1]], [[1, 5, 5], [1, 3, ord("a")]]]
    # sample 2 ends at its stop string, as a whole generation would: the token after it is dropped
    assert [c.token_ids for c in out] == [[7, 2], [5, 5, ord("b"), 9], [3, ord("a"), ord("b")]]
    assert [c.versions for c in out] == [[5, 5], [5, 5, 6, 6], [5, 5, 6]]
    assert [c.logprobs for c in out][2] == [-1.0, -1.0, -2.0]
    assert out[2].finish_reason == "stop" and out[1].finish_reason == "length"


def test_the_board_holds_the_newest_push_only():
    board = WeightBoard()
    assert board.newer_than(0) is None
    board.post(2, ["ref-2"])
    board.post(1, ["ref-1"])  # an older push arriving late changes nothing
    assert board.newer_than(1) == (2, ["ref-2"]) and board.newer_than(2) is None


def test_staleness_is_counted_per_token():
    whole = [Completion([1, 2], [0.0, 0.0], "stop")]
    assert staleness(whole, 5, 2) == {"rollout/staleness_max": 2.0, "rollout/staleness_mean": 2.0}
    mixed = [
        Completion([1, 2, 3, 4], [0.0] * 4, "stop", versions=[3, 3, 5, 5]),
        Completion([1], [0.0], "stop", versions=[3]),
    ]
    assert staleness(mixed, 5, 2) == {
        "rollout/staleness_max": 2.0,
        "rollout/staleness_mean": pytest.approx(6 / 5),
        "rollout/partial_samples": 0.5,
    }


def test_the_config_needs_batches_in_flight_and_single_turns():
    with pytest.raises(
        ConfigError, match=r"rollout.max_staleness=0 generates each batch .* set rollout.max_staleness >= 1"
    ):
        load_config("local", ["rollout.partial=true"])
    with pytest.raises(ConfigError, match="rollout.environment generates episodes of several turns"):
        load_config("local", ["rollout.partial=true", "rollout.max_staleness=1", "rollout.environment=x.py:Env"])
    cfg = load_config("local", ["rollout.partial=true", "rollout.max_staleness=1"])
    assert segment_tokens(cfg.rollout) == 1  # a quarter of the local preset's 4 new tokens
    cfg = load_config("local", ["rollout.partial=true", "rollout.max_staleness=1", "rollout.partial_segment_tokens=3"])
    assert segment_tokens(cfg.rollout) == 3


@pytest.mark.ray
def test_a_push_made_while_a_batch_generates_reaches_its_later_tokens(ray_local, tmp_path):
    """A real RolloutWorker actor: a batch started ahead, then a push of other weights while it generates; the
    samples' first segment has version 0, and tokens generated after the engine took the push version 1, with
    log-probs of the pushed weights. The engine's own ordered load of that push is then skipped."""
    import ray
    from cloudrl.trainer.algo.batch import to_wire
    from cloudrl.trainer.inputs.data import PromptRecord
    from cloudrl.trainer.inputs.demo import materialize_builtin
    from cloudrl.trainer.roles.workers import RolloutWorker
    from cloudrl.trainer.rollout.engines import PushedWeights
    from cloudrl.trainer.rollout.queue import RolloutQueue

    model_dir = materialize_builtin("tiny", warmup_steps=0)
    overrides = ["rollout.max_staleness=1", "rollout.partial=true", "rollout.partial_segment_tokens=2"]
    cfg = load_config("local", [*overrides, "rollout.max_new_tokens=200", f"trainer.run_dir={tmp_path}"])
    worker = ray.remote(num_cpus=0)(RolloutWorker).remote(cfg.to_dict(), model_dir)
    try:
        queue = RolloutQueue(
            [worker], ["rollout rank 0"], 60, score_here=lambda responses, records: [0.0] * len(responses)
        )
        queue.take_weights_mid_batch()
        tok = build_char_tokenizer()
        prompts = [PromptRecord(tok.encode(f"{i}+1=", add_special_tokens=False), f"{i}+1=", "", "") for i in range(4)]
        settings = SamplingSettings(n=2, max_new_tokens=200, temperature=1.0, seed=0)
        new = build_tiny_model(tok, seed=1).eval()
        queue.start(1, prompts, settings)
        pushed = PushedWeights((name, to_wire(p.detach())) for name, p in new.named_parameters())
        timings = queue.push(ray.put(pushed))
        got = queue.take(1, prompts, settings)
        loads = queue.settle()
    finally:
        ray.kill(worker)
    assert timings == {}
    long = [c for c in got.completions if len(c.token_ids) > 2]
    assert long, "every sample ended in its first segment"
    assert all(c.versions[:2] == [0, 0] for c in got.completions)
    switched = [c for c in long if c.versions[-1] == 1]
    assert switched, [c.versions for c in long]
    for c, prompt in ((c, prompts[got.completions.index(c) // 2].prompt_ids) for c in switched):
        cut = c.versions.index(1)
        assert c.versions == [0] * cut + [1] * (len(c.versions) - cut)
        after = _logprobs(new, prompt, c.token_ids, 1.0)[cut:]
        assert c.logprobs[cut:] == pytest.approx(after, abs=1e-4)
    assert loads["timing/engine_load"] == 0.0  # taken mid-batch: the ordered load was skipped
    metrics = got.metrics(torch.ones(len(got.completions), 1))
    assert metrics["rollout/partial_samples"] > 0 and metrics["rollout/staleness_max"] == 1.0
