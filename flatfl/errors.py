"""User-facing errors.

Every problem caused by the user's input (a bad name, a missing file, an impossible hyper-parameter, a diverging
run) is raised as a :class:`FlatflError`. The command line prints its message on one line and exits non-zero; it
never shows a traceback for these.
"""


class FlatflError(Exception):
    """A problem with the user's input or environment, reported as one clear line."""


class DatasetError(FlatflError):
    """A dataset is missing, corrupt or in the wrong layout."""


class CheckpointError(FlatflError):
    """A file is not a readable flatfl checkpoint, or does not match the model it claims."""


class ConfigError(FlatflError):
    """An unknown name or an impossible hyper-parameter value."""


class DivergenceError(FlatflError):
    """Training produced a non-finite loss."""
