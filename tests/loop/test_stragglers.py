"""Slow nodes found (trainer/stragglers.py): the rule on made-up timings, then real Ray actors behind the hang
watch's wait, one of them slower, named after three rounds."""

from __future__ import annotations

import pytest
from cloudrl.trainer import hangs
from cloudrl.trainer.stragglers import Stragglers

FAST, SLOW = "rollout rank 0 on 10.0.0.2", "rollout rank 1 on 10.0.0.3"


def test_a_worker_slow_three_rounds_in_a_row_is_named_once():
    s = Stragglers()
    assert s.observe("generation", {FAST: 4.0, SLOW: 9.0}) == []
    assert s.observe("generation", {FAST: 4.0, SLOW: 9.0}) == []
    (line,) = s.observe("generation", {FAST: 4.0, SLOW: 9.0})
    assert line.startswith(f"straggler: {SLOW} took 2.2x the others' median generation time (9.0s against 4.0s)")
    assert s.observe("generation", {FAST: 4.0, SLOW: 9.0}) == []  # once
    assert s.metrics() == {"health/stragglers": 1.0}


def test_a_slow_worker_in_a_short_phase_is_named_when_it_is_half_a_second_late():
    s = Stragglers()
    for _ in range(2):
        assert s.observe("generation", {FAST: 0.2, SLOW: 8.0}) == []
    (line,) = s.observe("generation", {FAST: 0.2, SLOW: 8.0})
    assert line.startswith(f"straggler: {SLOW} took 40.0x the others' median generation time (8.0s against 0.2s)")


def test_a_round_at_normal_speed_starts_the_count_again():
    s = Stragglers()
    for seconds in (9.0, 9.0, 4.2, 9.0, 9.0):
        assert s.observe("actor update", {FAST: 4.0, "actor rank 2": 4.1, SLOW: seconds}) == []
    assert s.observe("actor update", {FAST: 4.0, "actor rank 2": 4.1, SLOW: 9.0}) != []


def test_short_phases_and_lone_workers_are_not_judged():
    s = Stragglers()
    for _ in range(5):
        assert s.observe("reward", {FAST: 0.1, SLOW: 0.4}) == []  # 4x, but less than half a second longer
        assert s.observe("generation", {SLOW: 60.0}) == []  # nobody to compare with
        assert s.observe("critic update", {FAST: 4.0, SLOW: 5.9}) == []  # under 1.5x
    assert s.metrics() == {"health/stragglers": 0.0}


@pytest.mark.ray
def test_the_watch_names_the_slower_actor_after_three_rounds(ray_local, capsys):
    import time

    import ray

    @ray.remote(num_cpus=0)
    class Engine:
        def generate(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    fast, slow = Engine.remote(), Engine.remote()
    try:
        assert ray.get([fast.generate.remote(0), slow.generate.remote(0)], timeout=120) == [0, 0]  # both started
        with hangs.WATCH.watching(None, hang_timeout_s=60):
            for _ in range(3):
                refs = [fast.generate.remote(0.6), slow.generate.remote(1.8)]
                assert hangs.WATCH.wait("generation", refs, [FAST, SLOW], "generating") == [0.6, 1.8]
            assert hangs.WATCH.stragglers.metrics() == {"health/stragglers": 1.0}
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("straggler: ")]
        assert len(lines) == 1 and lines[0].startswith(f"straggler: {SLOW} took "), lines
        assert 2.0 <= float(lines[0].split(" took ")[1].split("x")[0]) <= 3.5, lines  # 1.8 s against 0.6 s
    finally:
        ray.kill(fast)
        ray.kill(slow)
