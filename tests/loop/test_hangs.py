"""The hang watch (trainer/hangs.py): a worker stuck in a wait of the loop is named with the file and line it
sits in, its stacks are kept in run_dir/hangs/, and the attempt ends so recovery can restart it.

In order: the dump's parsing (no process), a real process stuck in user code and dumped by signal (no Ray),
a stuck Ray actor behind `Watch.wait` on the session's Ray instance, a rank stuck in a collective that another
rank skipped, and a whole run whose reward function never returns."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from cloudrl.trainer import hangs
from cloudrl.trainer.errors import WorkerHung, WorkerTimeout
from cloudrl.trainer.hangs import Frame, Watch, dump_stack, threads, where_stuck
from runs import ROLLOUT_IN_ACTOR, WITHOUT_CRITIC, run_trainer, tiny_overrides

PACKAGE = hangs.PACKAGE
STDLIB = os.path.dirname(os.__file__)

DUMP = f"""Thread 0x00007f0000000001 (most recent call first):
  File "{STDLIB}/threading.py", line 331 in wait
  File "{STDLIB}/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "{STDLIB}/time.py", line 1 in sleep_helper
  File "/home/me/rewards/slow.py", line 7 in score
  File "{PACKAGE}/inputs/rewards.py", line 120 in score_responses
  File "{PACKAGE}/roles/workers.py", line 450 in score
  File "{STDLIB}/runpy.py", line 88 in _run_code
"""


def test_a_dump_parses_into_threads_of_frames_innermost_first():
    parsed = threads(DUMP)
    assert [len(t) for t in parsed] == [2, 5]
    assert parsed[1][1] == Frame("/home/me/rewards/slow.py", 7, "score")
    assert threads("") == [] and threads("garbage\n  File nowhere\n") == []


def test_the_users_frame_is_named_in_the_thread_running_a_cloudrl_call():
    assert where_stuck(DUMP) == "in your code at /home/me/rewards/slow.py:7 in score"


def test_without_user_code_the_innermost_frame_of_the_cloudrl_call_is_named():
    ours_only = DUMP.replace("/home/me/rewards/slow.py", f"{PACKAGE}/rollout/queue.py")
    assert where_stuck(ours_only) == f"at {STDLIB}/time.py:1 in sleep_helper"
    assert where_stuck("") == ""


def test_the_bound_is_the_floor_or_five_times_the_phases_median():
    watch = Watch()
    with watch.watching(None, hang_timeout_s=60):
        assert watch.bound("generation") == 60
        watch.durations["generation"] += [10, 30, 20]
        assert watch.bound("generation") == 100  # 5 x the median, 20 s
        assert watch.bound("reward") == 60  # each phase its own
    assert watch.hang_timeout_s == 0 and not watch.durations  # outside an attempt: unbounded again


def test_labels_the_watch_does_not_know_are_not_explained():
    assert Watch().explain(["node 1a2b3c4d"], "looking for the model") == ""


STUCK = """\
import sys, time
sys.path[:0] = [{root!r}]
from cloudrl.trainer.hangs import arm_stack_dump

def score(samples):
    print("armed", flush=True)
    while True:
        time.sleep(0.05)  # a reward that never returns

arm_stack_dump()
score([])
"""


def test_a_stuck_process_dumps_its_stack_on_the_signal_and_keeps_running(tmp_path):
    """No Ray: the same dump a worker gives, asked for by PID as the task on its node does."""
    script = tmp_path / "slow_reward.py"
    script.write_text(STUCK.format(root=str(tmp_path)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "armed"
        time.sleep(0.5)  # into the loop
        dump = dump_stack(proc.pid)
        assert f'File "{script}", line 8 in score' in dump, dump
        assert where_stuck(dump) == f"in your code at {script}:8 in score"
        assert proc.poll() is None  # the dump does not stop it
        assert dump_stack(proc.pid) != ""  # and a second one works too
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert dump_stack(proc.pid) == ""  # a process that is gone gives nothing, at once


@pytest.mark.ray
def test_a_stuck_actor_is_named_where_it_sits_and_its_stacks_are_kept(ray_local, tmp_path):
    import ray

    source = tmp_path / "stuck_actor.py"
    source.write_text(
        textwrap.dedent(
            """\
            import os, time

            class Stuck:
                def where(self):
                    from cloudrl.trainer.hangs import arm_stack_dump
                    import ray
                    arm_stack_dump()
                    return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

                def work(self, seconds):
                    time.sleep(seconds)  # the stuck call
                    return seconds
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import stuck_actor
    finally:
        sys.path.remove(str(tmp_path))
    actor = ray.remote(num_cpus=0, runtime_env={"env_vars": {"PYTHONPATH": str(tmp_path)}})(stuck_actor.Stuck).remote()
    watch = hangs.WATCH
    try:
        label = "reward rank 0 on 127.0.0.1"
        watch.register([label], [ray.get(actor.where.remote(), timeout=120)])
        with watch.watching(tmp_path / "run", hang_timeout_s=2):
            assert watch.wait("reward", [actor.work.remote(0)], [label], "scoring") == [0]
            start = time.monotonic()
            with pytest.raises(WorkerHung) as err:
                watch.wait("reward", [actor.work.remote(600)], [label], "scoring step 1's samples")
            assert time.monotonic() - start < 60
        message = str(err.value)
        assert "\n" not in message and "trainer.hang_timeout_s=2s" in message, message
        assert f"{label} is in your code at {source}:11 in work" in message, message
        assert err.value.lost.startswith(f"{label}: hung (scoring step 1's samples: no answer within 2s)")
        assert isinstance(err.value, WorkerTimeout) and err.value.late == [label]
        (kept,) = (tmp_path / "run" / "hangs").iterdir()
        assert kept.name.endswith("scoring-step-1-s-samples") and str(kept) in message
        assert f'File "{source}", line 11 in work' in (kept / "reward-rank-0-on-127.0.0.1.txt").read_text()
    finally:
        ray.kill(actor)


COLLECTIVE_RANK = """\
import os
from datetime import timedelta

import torch
import torch.distributed as dist


class Rank:
    def where(self):
        from cloudrl.trainer.hangs import arm_stack_dump
        import ray
        arm_stack_dump()
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def open_store(self):
        from cloudrl.trainer.rendezvous import listening_store
        self.store = listening_store("127.0.0.1", 2, timedelta(seconds=600))
        return self.store.port

    def join(self, rank, port):
        store = getattr(self, "store", None) or dist.TCPStore("127.0.0.1", port, 2, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=600))
        return rank

    def step(self, skip_all_reduce):
        value = torch.ones(4)
        if not skip_all_reduce:
            dist.all_reduce(value)  # rank 0 waits here for a rank that never comes
        return float(value.sum())
"""


@pytest.mark.ray
def test_a_rank_stuck_in_a_collective_is_named_at_its_all_reduce(ray_local, tmp_path):
    """Two ranks of a gloo group on the session's Ray instance; rank 1 skips an all-reduce that rank 0 enters,
    as when one rank takes another code path. The watch names rank 0 at the line of its all-reduce, and its
    kept stack holds torch's all_reduce frame."""
    import ray

    source = tmp_path / "collective_rank.py"
    source.write_text(COLLECTIVE_RANK)
    sys.path.insert(0, str(tmp_path))
    try:
        import collective_rank
    finally:
        sys.path.remove(str(tmp_path))
    actor_cls = ray.remote(num_cpus=0, runtime_env={"env_vars": {"PYTHONPATH": str(tmp_path)}})(collective_rank.Rank)
    ranks = [actor_cls.remote() for _ in range(2)]
    labels = [f"actor rank {r} on 127.0.0.1" for r in range(2)]
    watch = hangs.WATCH
    try:
        watch.register(labels, ray.get([r.where.remote() for r in ranks], timeout=120))
        port = ray.get(ranks[0].open_store.remote(), timeout=120)
        assert ray.get([r.join.remote(i, port) for i, r in enumerate(ranks)], timeout=120) == [0, 1]
        with watch.watching(tmp_path / "run", hang_timeout_s=3):
            start = time.monotonic()
            refs = [ranks[0].step.remote(False), ranks[1].step.remote(True)]
            with pytest.raises(WorkerHung) as err:
                watch.wait("actor update", refs, labels, "step 1: the actor's update")
            assert time.monotonic() - start < 60
        message = str(err.value)
        assert "\n" not in message and "trainer.hang_timeout_s=3s" in message, message
        assert err.value.late == [labels[0]], err.value.late  # rank 1 returned; rank 0 did not
        assert f"{labels[0]} is in your code at {source}:28 in step" in message, message
        (kept,) = (tmp_path / "run" / "hangs").iterdir()
        stack = (kept / "actor-rank-0-on-127.0.0.1.txt").read_text()
        assert f'File "{source}", line 28 in step' in stack
        assert "distributed_c10d.py" in stack and "in all_reduce" in stack, stack
    finally:
        for rank in ranks:
            ray.kill(rank)


SLOW_REWARD = """\
import time

def score(completions, ground_truth, **kwargs):
    while True:
        time.sleep(0.1)  # never returns
"""


@pytest.mark.ray
def test_a_run_whose_reward_never_returns_names_its_line_and_ends(ray_local, tmp_path):
    """reward.timeout_s=0 (no limit of its own): the hang watch ends the attempt, and with no restart left
    the run, in one line naming the reward worker and the line it sits in."""
    reward = tmp_path / "slow_reward.py"
    reward.write_text(SLOW_REWARD)
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(
        run_dir,
        **{
            "reward.function": f"{reward}:score",
            "reward.timeout_s": 0,
            "trainer.hang_timeout_s": 15,
            "trainer.max_restarts": 0,
            **WITHOUT_CRITIC,
            **ROLLOUT_IN_ACTOR,  # the actor and the reward worker
        },
    )
    result = run_trainer("--preset", "local", *overrides, env={"RAY_ADDRESS": ray_local}, timeout=300)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = errors[0]
    assert "reward rank 0 on " in line and ": hung (" in line and "no answer within 15s" in line, line
    assert f"in your code at {reward}:5 in score" in line, line
    assert "no restart left (trainer.max_restarts=0)" in line, line
    (kept,) = (run_dir / "hangs").iterdir()
    assert f'File "{reward}", line 5 in score' in next(kept.iterdir()).read_text()
