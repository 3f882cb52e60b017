"""Start-up behaviour of the ``flatfl`` command: Ctrl-C while the heavy imports (torch) run gives one line, not a
traceback. Installed first thing by both entry points (``python -m flatfl`` and the ``flatfl`` console script);
this module imports nothing but ``sys``."""
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
