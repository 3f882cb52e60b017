import sys


def _interrupted_hook(kind, value, tb, _previous=sys.excepthook):
    """Ctrl-C while flatfl is still importing: one line, not a traceback."""
    if issubclass(kind, KeyboardInterrupt):
        sys.stderr.write("flatfl: interrupted\n")
        return
    _previous(kind, value, tb)


sys.excepthook = _interrupted_hook

from .cli import main  # noqa: E402

if __name__ == "__main__":
    main()
