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


def unknown_name(kind: str, name, choices, where: str = "", fallback: str | None = None) -> ConfigError:
    """The one error for a name that is not among ``choices`` (an algorithm, a model, a dataset, a setting...): with
    a close valid name, ``unknown algorithm 'fedavgg'. Did you mean 'fedavg'?`` (``where``, e.g. 'in c.toml', after
    the name); without one, ``fallback`` or the valid names listed. Returned, not raised (``raise unknown_name(...)``),
    so that the caller's traceback points at the check."""
    import difflib

    choices = [str(c) for c in choices]
    place = f" {where}" if where else ""
    close = difflib.get_close_matches(str(name).lower(), [c.lower() for c in choices], n=1, cutoff=0.6) \
        if isinstance(name, str) else []
    if close:
        match = next(c for c in choices if c.lower() == close[0])
        return ConfigError(f"unknown {kind} {name!r}{place}. Did you mean {match!r}?")
    return ConfigError(fallback or f"unknown {kind} {name!r}{place}: choose one of {', '.join(choices)}")
