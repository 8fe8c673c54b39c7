"""The rollout engines a run generates with, as they come and go: the queue's members.

    pool = EnginePool(engines, labels)
    pool.replace_lost(group)        # a lost engine costs no restart: a new one starts in its slot
    pool.grow_to(4)                 # rollout.elastic: more engines as the cluster has room for them
    pool.alive()                    # the engines to send work to
    pool.lost_one(engine, exc)      # its call ended with its actor's death
    pool.admit()                    # at a push, before its weights are sent: the started ones join (their times)

An engine holds no training state: its weights are the last push, its work one batch's part. So where the
weights reach the engines through the object store (`WeightPush.engines_replaceable`), the loss of one is
its part of a batch generated again by the others (rollout/queue.py) and a new engine in its slot of the
placement group (`ActorGroup.respawn`); and with rollout.elastic one more engine at a time waits, in a
placement group of its own, for a node with room (`ActorGroup.grow`). Either joins at the first push after
it has started: an engine runs its calls in the order one caller sent them, so it loads those weights before
anything it is then sent to generate. Every change is one line in the run's log.
"""

from __future__ import annotations

import time

from ..errors import first_line
from ..waiting import trainer_error_in

REPLACEMENTS_PER_ENGINE = 3
"""How many times one engine is replaced after a loss in one start of the run; past it, it stays lost."""


class EnginePool:
    def __init__(self, engines: list, labels: list[str]):
        self.actors = list(engines)
        """Each engine's actor, by index (the rollout group's rank)."""
        self.labels = list(labels)
        """`rollout rank 1 on 10.0.0.2` per engine, for messages and the hang watch."""
        self.group = None
        """The rollout engines' ActorGroup where engines are replaced and added (`replace_lost`), else None."""
        self.max_engines = 0
        """rollout.elastic: engines are added up to this many (`grow_to`); 0 = none added."""
        self.lost: dict[int, float] = {}
        """Engines lost and not back: index -> time.monotonic() of the loss."""
        self.joining: dict[int, tuple] = {}
        """Engines being started (replacements, and an added one): index -> (the new actor, its `where` call)."""
        self.asked: dict[int, float] = {}
        """When each engine being started was asked for (time.monotonic())."""
        self.replaced: dict[int, int] = {}
        """Replacements started so far, per engine."""

    def replace_lost(self, group) -> None:
        """From now on, an engine that dies (its process or its node) costs no restart: the queue sends its
        part of a batch to the engines left, and a new engine starts in its slot (`group.respawn`)."""
        self.group = group

    def grow_to(self, max_engines: int) -> None:
        """rollout.elastic: from now on, while there are fewer than `max_engines` engines, one more waits for
        room on the cluster (`group.grow`). Needs `replace_lost` (the same conditions)."""
        self.max_engines = max_engines

    @property
    def replaceable(self) -> bool:
        return self.group is not None

    def alive(self) -> list[int]:
        """The engines that generate: not lost (a replacement counts from the push that gave it weights)."""
        return [e for e in range(len(self.actors)) if e not in self.lost]

    def lost_one(self, engine: int, exc: BaseException) -> None:
        """Engine `engine` died: one line, and a replacement started in its slot (bounded per engine). The
        last engine's loss is not replaced here: the caller raises it, and the run's restart starts them all."""
        if engine in self.lost:
            return
        self.lost[engine] = time.monotonic()
        if not self.alive():
            return
        cause = first_line(str(exc))[:200]
        left = f"{self.labels[engine]} was lost ({cause}): the run goes on with {len(self.alive())} engine(s)"
        tries = self.replaced.get(engine, 0)
        if tries >= REPLACEMENTS_PER_ENGINE:
            print(f"{left}; it was replaced {tries} times already and stays lost", flush=True)
            return
        self.replaced[engine] = tries + 1
        try:
            handle = self.group.respawn(engine)
        except Exception as start_exc:  # Ray refused the new actor (its placement group gone): the run goes on
            print(f"{left}; no new engine could be started: {first_line(str(start_exc))[:200]}", flush=True)
            return
        self._asked_for(engine, handle)
        print(f"{left}; a new engine is starting in its place", flush=True)

    def grow(self) -> None:
        """rollout.elastic: one more engine on its way while there are fewer than `max_engines` (one at a time)."""
        engine = len(self.actors)
        if engine >= self.max_engines or engine in self.joining:
            return
        try:
            handle = self.group.grow()
        except Exception as exc:  # Ray refused the placement group: no more engines are added
            print(f"rollout.elastic: no engine can be added: {first_line(str(exc))[:200]}", flush=True)
            self.max_engines = 0
            return
        self._asked_for(engine, handle)

    def _asked_for(self, engine: int, handle) -> None:
        self.joining[engine] = (handle, handle.where.remote())
        self.asked[engine] = time.monotonic()

    def admit(self) -> dict[str, float]:
        """The engines that have started join now (called at a push, before its weights are sent). Returns the
        push's metrics: the longest time from a loss to its replacement joining (`rollout/engine_replace_s`) and
        from asking for an added engine to its joining (`rollout/engine_join_s`), each only where one joined."""
        import ray

        took: dict[str, float] = {}
        for engine, (handle, ready) in sorted(self.joining.items()):
            if not ray.wait([ready], timeout=0)[0]:
                continue
            del self.joining[engine]
            try:
                place = ray.get(ready, timeout=0)
            except Exception as exc:
                self._not_started(engine, exc)
                continue
            label = self.group.placed(engine, place)
            asked = self.asked.pop(engine)
            if engine == len(self.actors):  # added
                self.actors.append(handle)
                self.labels.append(label)
                seconds = time.monotonic() - asked
                took["rollout/engine_join_s"] = max(seconds, took.get("rollout/engine_join_s", 0.0))
                print(
                    f"{label} joined (rollout.elastic, {seconds:.0f} s after it was asked for): "
                    f"{len(self.alive())} engine(s) generate from the next batch, with the weights pushed now",
                    flush=True,
                )
            else:
                self.actors[engine] = handle
                self.labels[engine] = label
                seconds = time.monotonic() - self.lost.pop(engine)
                took["rollout/engine_replace_s"] = max(seconds, took.get("rollout/engine_replace_s", 0.0))
                print(
                    f"{label} is back {seconds:.0f} s after the loss: it generates from the next batch, with the "
                    f"weights pushed now",
                    flush=True,
                )
        return took

    def _not_started(self, engine: int, exc: BaseException) -> None:
        """A replacement or an added engine failed before it answered. One that died starting is replaced
        (bounded per engine); a start error (no model on its node, ...) would come again: it is named once,
        and no engine is added after a failed one."""
        added = engine == len(self.actors)
        cause = trainer_error_in(exc)
        self.asked.pop(engine, None)
        if cause is None and not added:
            self.lost.pop(engine, None)
            self.lost_one(engine, exc)
            return
        what = f"the engine added as rollout rank {engine}" if added else f"the new engine for {self.labels[engine]}"
        print(
            f"{what} could not start: {first_line(str(cause or exc))[:300]}; the run goes on with "
            f"{len(self.alive())} engine(s){'; no more engines are added' if added else ''}",
            flush=True,
        )
        if added:
            self.max_engines = 0


def died(ref) -> bool:
    """Whether the call `ref` has ended with its actor's death (not with an error of its own)."""
    import ray
    from ray.exceptions import RayActorError

    if not ray.wait([ref], timeout=0)[0]:
        return False
    try:
        ray.get(ref, timeout=0)
    except RayActorError:
        return True
    except Exception:
        return False
    return False
