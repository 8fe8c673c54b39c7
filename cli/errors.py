"""The one exception type for failures a user can fix; the CLI prints its message as one red line."""


class CloudrlError(Exception):
    """An expected failure: the message says what went wrong and the command or flag that fixes it."""
