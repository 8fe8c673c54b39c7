"""The trainer's expected failures: each message names the problem and the fix."""


class ConfigError(ValueError):
    """A config problem the user can fix; the message names the key and the fix."""


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says what to check."""


class DataError(ValueError):
    """A dataset or reward function the trainer cannot use."""


class PlacementTimeout(RuntimeError):
    """Ray could not place a role's workers in time."""


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be written or read."""


# What `python -m cloudrl.trainer` reports as one line instead of a traceback.
TrainerError = (ConfigError, ModelLoadError, DataError, PlacementTimeout, CheckpointError)
