"""Start-up behaviour of the ``flatfl`` command: Ctrl-C while the heavy imports (torch) run gives one line, not a
traceback. Installed first thing by both entry points (``python -m flatfl`` and the ``flatfl`` console script);
this module imports nothing but ``os``, ``sys`` and ``signal``."""
import os
import signal
import sys


def _interrupted_hook(kind, value, tb, _previous=sys.excepthook):
    if issubclass(kind, KeyboardInterrupt):
        sys.stderr.write("flatfl: interrupted\n")
        return
    _previous(kind, value, tb)


def install_interrupt_hook() -> None:
    """Make an uncaught KeyboardInterrupt print 'flatfl: interrupted' (other exceptions keep the previous hook)."""
    if sys.excepthook is not _interrupted_hook:
        sys.excepthook = _interrupted_hook


def import_torch_uninterruptibly() -> None:
    """Import torch with Ctrl-C held back: a KeyboardInterrupt raised inside torch's C++ initialisation can abort
    the process with a pybind11 error instead of unwinding. While torch imports, SIGINT only records that it came;
    once the import is done the previous handler is back and a recorded Ctrl-C is raised as KeyboardInterrupt
    (one line, through the hook above). SIGINT ignored by the parent (``nohup``, ``cmd &``) stays ignored."""
    if "torch" in sys.modules:
        return
    pressed = []
    try:
        previous = signal.getsignal(signal.SIGINT)
        if previous is signal.SIG_IGN:
            raise ValueError
        signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    except ValueError:  # ignored by the parent, or not the main thread: import as it is
        import torch  # noqa: F401
        return
    try:
        import torch  # noqa: F401,F811
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


def settle_source_date_epoch() -> str | None:
    """``SOURCE_DATE_EPOCH`` (reproducible builds: the time a report's title page shows) as the libraries flatfl
    uses can read it: set but blank, it is taken as not set (removed from this process's environment and its
    children's, where numpy and fontTools would fail on it); set to anything but a whole number of seconds, the
    problem is returned as one line (else None)."""
    raw = os.environ.get("SOURCE_DATE_EPOCH")
    if raw is None:
        return None
    if not raw.strip():
        del os.environ["SOURCE_DATE_EPOCH"]
        return None
    if not raw.strip().isdigit() or len(raw.strip()) > 12:
        return (f"SOURCE_DATE_EPOCH must be a non-negative integer (seconds since 1970), got {raw[:40]!r}; "
                "unset it or leave it empty to use the current time")
    return None
