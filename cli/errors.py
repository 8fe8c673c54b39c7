"""The one exception type for failures a user can fix; the CLI prints its message as one red line.

It extends the trainer's base error, so the CLI's handler catches one class for both: its own
failures, and the trainer's (a config key, a missing file) raised while a command checks a config.
A cluster that does not answer is the trainer's `ClusterUnreachable` (a TrainerError, not a
CloudrlError): code that polls a cluster catches both.
"""

from cloudrl.trainer.errors import TrainerError


class CloudrlError(TrainerError):
    """An expected failure: the message says what went wrong and the command or flag that fixes it."""


class NoSuchJob(CloudrlError):
    """The cluster answers but has no job with that id."""
