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
    short = [c for c in choices if isinstance(name, str) and abbreviates(name, c)]
    if len(short) == 1:  # 'fmnist' for 'fashion-mnist': a shortening of each word, closer than any typo
        return ConfigError(f"unknown {kind} {name!r}{place}. Did you mean {short[0]!r}?")
    close = difflib.get_close_matches(str(name).lower(), [c.lower() for c in choices], n=1, cutoff=0.6) \
        if isinstance(name, str) else []
    if close:
        match = next(c for c in choices if c.lower() == close[0])
        return ConfigError(f"unknown {kind} {name!r}{place}. Did you mean {match!r}?")
    return ConfigError(fallback or f"unknown {kind} {name!r}{place}: choose one of {', '.join(choices)}")


def abbreviates(name: str, choice: str) -> bool:
    """Whether ``name`` shortens a name of several words (split at '-', '_', spaces) by keeping the start of each
    word, in order: 'fmnist' and 'fashmnist' shorten 'fashion-mnist'; a one-word name has no such shortening."""
    import re

    words = [w for w in re.split(r"[-_ ]+", choice.lower()) if w]
    text = re.sub(r"[-_ ]+", "", name.lower())
    if len(words) < 2 or not text or len(text) > len("".join(words)) or text == "".join(words):
        return False

    def match(i: int, k: int) -> bool:
        if k == len(words):
            return i == len(text)
        return any(text.startswith(words[k][:j], i) and match(i + j, k + 1) for j in range(len(words[k]), 0, -1))

    return match(0, 0)


#: the longest error line the command line prints (a value quoted from a file can be any length)
MAX_ERROR_LINE = 600


def error_line(text: str, limit: int = MAX_ERROR_LINE) -> str:
    """``text`` on one line, cut to ``limit`` characters (saying how much was left out)."""
    text = " ".join(str(text).splitlines())
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def raised_in(e: BaseException) -> str | None:
    """Where ``e`` was raised, when that is not flatfl's own code: ``function (file:line)`` of the innermost frame
    of its traceback (the user's loss, network or factory, a plug-in); None when flatfl's code raised it."""
    import os

    tb = e.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    if os.path.abspath(code.co_filename).startswith(here):
        return None
    return f"{code.co_name} ({code.co_filename}:{tb.tb_lineno})"


def _not_yours() -> tuple[str, ...]:
    """The folders of flatfl's code, the installed packages' and Python's own, each ending in a separator."""
    import os
    import sysconfig

    roots = {os.path.dirname(os.path.abspath(__file__))}
    roots |= {os.path.abspath(p) for p in (sysconfig.get_paths().get(k) for k in
                                           ("stdlib", "platstdlib", "purelib", "platlib")) if p}
    return tuple(root + os.sep for root in roots)


def users_file(filename: str) -> bool:
    """Whether code of the file ``filename`` (a code object's ``co_filename``) is yours: neither flatfl's nor an
    installed package's nor Python's own (nor generated, ``<string>``)."""
    import os

    global _ROOTS
    if _ROOTS is None:
        _ROOTS = _not_yours()
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(_ROOTS)


_ROOTS: tuple[str, ...] | None = None  # set by users_file on first use


def user_frame(e: BaseException, innermost: bool = False) -> str | None:
    """The innermost frame of ``e``'s traceback in code that is neither flatfl's nor an installed package's nor
    Python's own (your network's ``forward``, a loss, a factory; :func:`users_file`): ``function (file:line)``, or
    None. With ``innermost``, only the frame that raised counts (None when torch, say, raised it under your code)."""
    found, tb = None, e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if users_file(code.co_filename):
            found = f"{code.co_name} ({code.co_filename}:{tb.tb_lineno})"
        elif innermost:
            found = None
        tb = tb.tb_next
    return found
