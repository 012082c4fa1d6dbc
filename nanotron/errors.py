"""User-facing errors: one type per domain, printed once as one line with exit code 2."""


class UserError(Exception):
    """Bad input from the user: a message that names the key or file, what was expected, and a fix."""

    exit_code = 2


class ConfigError(UserError):
    """A config file, override or flag is wrong."""


class DataError(UserError):
    """A dataset or tokenizer can't be found or used."""


class CheckpointError(UserError):
    """A checkpoint can't be written, found or loaded."""
