"""Start-up behaviour of the ``flatfl`` command: Ctrl-C while the heavy imports (torch) run gives one line, not a
traceback. Installed first thing by both entry points (``python -m flatfl`` and the ``flatfl`` console script);
this module imports nothing but ``sys`` and ``signal``."""
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
