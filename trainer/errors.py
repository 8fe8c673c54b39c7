"""The trainer's expected failures: each message names the problem and the fix.

`python -m cloudrl.trainer` reports any `TrainerError` as one line instead of a traceback.
"""


class TrainerError(Exception):
    """Base of every expected failure."""


class ConfigError(TrainerError, ValueError):
    """A config problem the user can fix; the message names the key and the fix."""


class ModelLoadError(TrainerError, RuntimeError):
    """A model or tokenizer could not be loaded; the message says what to check."""


class DataError(TrainerError, ValueError):
    """A dataset or reward function the trainer cannot use."""


class PlacementTimeout(TrainerError, RuntimeError):
    """Ray could not place a role's workers in time."""


class WorkerTimeout(TrainerError, RuntimeError):
    """A worker or engine did not answer in time (process-group start, engine start, weight sync)."""

    def __init__(self, message: str, late: list[str] | tuple = (), stuck: str = ""):
        super().__init__(message)
        self.late = list(late)
        """The labels of the calls that did not answer (`actor rank 1 on 10.0.0.2`)."""
        self.stuck = stuck
        """Where those workers were stuck, when the driver could ask them (hangs.Watch.explain); else ""."""


class WorkerHung(WorkerTimeout):
    """A watched wait of the loop ran out (trainer.hang_timeout_s, hangs.py): recovery restarts the roles."""

    def __init__(self, message: str, late: list[str], stuck: str, lost: str):
        super().__init__(message, late, stuck)
        self.lost = lost
        """`actor rank 0 on 10.0.0.2: hung (the actor's update: no answer within 600s)`: what recovery reports."""


class NodePreempted(TrainerError, RuntimeError):
    """A node holding roles has a preemption notice (Ray drains it): the step just finished is saved and
    recovery restarts the roles on the nodes that stay (recovery.py `leave_preempted_nodes`)."""

    def __init__(self, message: str, lost: str, node_id: str):
        super().__init__(message)
        self.lost = lost
        """`node 10.0.0.2 (id ..., held actor rank 1) to a preemption notice (...)`: what recovery reports."""
        self.node_id = node_id
        """The Ray node id of the node with the notice."""


class CheckpointError(TrainerError, RuntimeError):
    """A checkpoint directory that cannot be written or read."""


class EngineMismatch(TrainerError, RuntimeError):
    """The engines sample another distribution than the trainer trains (trainer.gap_check=fail)."""


class RewardError(DataError):
    """A reward function that raised or returned what the trainer cannot use, while training."""


class EnvironmentFailed(DataError):
    """A rollout.environment whose reset, step or step_many raised or returned the wrong type, where that
    stops the run: its `errors_are_fatal`, or every episode of a batch failed."""


class RunDirError(TrainerError, ValueError):
    """A trainer.run_dir that is empty or holds another run's files (never silently rewritten)."""


class Stopped(TrainerError, RuntimeError):
    """SIGTERM (cloudrl stop, dstack stop, a spot preemption) ended the run after checkpointing its last step."""


class RecoveryFailed(TrainerError, RuntimeError):
    """The run lost a worker or node and could not restart (restarts used up, or no capacity came back)."""


class ClusterUnreachable(TrainerError, ConnectionError):
    """No Ray cluster answers at an address: the GCS the trainer was told to join, or the dashboard a
    `cloudrl` command talks to."""


def first_line(text: object, default: str = "no details") -> str:
    """The first non-empty line of a message or an exception's text: what one-line errors quote."""
    stripped = str(text).strip()
    return stripped.splitlines()[0] if stripped else default
