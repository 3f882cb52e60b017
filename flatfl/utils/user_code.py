"""Code of yours that flatfl runs (a ``--loss``, a ``--model-factory`` and the modules they import) breaks only
itself: what it changes of the process is put back when it returns (docs/reliability.md, "Plug-ins and your own
code").

:func:`user_code` is the block around one call (or one import) of such code; :func:`guard_forward` puts every call
of a network of yours (a ``--model-factory``'s) in one. When the block ends, however it ends:

* the **working directory** is the one it began in (a relative ``--out`` still names the folder the command prints);
* torch's **grad mode** is as it was (``torch.set_grad_enabled(False)`` in a loss would leave the Hessian's products
  without a graph);
* ``sys.stdout`` and ``sys.stderr`` are the streams it began with, opened again on their file descriptors when your
  code closed them (so that the result line is still printed).

Each change is said once a process, in one ``flatfl: notice:`` line naming the code (:data:`NOTICES` keeps which
were said). Threads your code starts and leaves running are the command line's to name at the end
(:func:`flatfl.cli.common.finish`).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

__all__ = ["user_code", "guarded", "guard_forward", "NOTICES"]

#: the kinds of change already said in this process ('working directory', 'grad mode', 'sys.stdout', ...)
NOTICES: set[str] = set()


def _notice(kind: str, text: str) -> None:
    if kind in NOTICES:
        return
    NOTICES.add(kind)
    try:
        print(f"flatfl: notice: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _reopened(stream, fd: int | None):
    """A text stream like ``stream`` (closed by your code) on its file descriptor ``fd``, or None when ``fd`` is
    closed too."""
    if fd is None:
        return None
    try:
        os.fstat(fd)
        return open(fd, "w", buffering=1 if getattr(stream, "line_buffering", False) else -1,  # noqa: SIM115
                    encoding=getattr(stream, "encoding", None) or "utf-8",
                    errors=getattr(stream, "errors", None) or "strict", closefd=False)
    except (OSError, ValueError, TypeError, LookupError):
        return None


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


@contextlib.contextmanager
def user_code(what: str) -> Iterator[None]:
    """The block runs code of yours (``what`` names it in a notice: 'the loss my_loss.py:loss'); when it ends, the
    working directory, torch's grad mode and the standard streams are as they were when it began."""
    import torch

    try:
        cwd = os.getcwd()
    except OSError:  # the folder the command began in is gone: nothing to go back to
        cwd = None
    grad = torch.is_grad_enabled()
    streams = {name: getattr(sys, name) for name in ("stdout", "stderr")}
    fds = {name: _fileno(stream) for name, stream in streams.items()}
    collected = False
    try:
        yield
    except GeneratorExit:  # a block never ended, closed when the garbage collector finds it: the call it guarded is
        collected = True  # long over, and what it would put back (streams of that time) would replace today's
        raise
    finally:
        if not collected:
            _restore(what, streams, fds, grad, cwd)


def _restore(what: str, streams: dict, fds: dict, grad: bool, cwd: str | None) -> None:
    """Put back what a :func:`user_code` block began with (its docstring), each change said once a process."""
    import torch

    for name, stream in streams.items():
        now = getattr(sys, name)
        if getattr(stream, "closed", False):
            again = _reopened(stream, fds[name])
            if again is not None:
                setattr(sys, name, again)
                _notice(f"sys.{name}", f"{what} closed sys.{name}; flatfl opened it again")
        elif now is not stream:
            setattr(sys, name, stream)
            _notice(f"sys.{name}", f"{what} replaced sys.{name}; flatfl put it back")
    if torch.is_grad_enabled() != grad:
        torch.set_grad_enabled(grad)
        _notice("grad mode", f"{what} turned torch's gradients {'off' if grad else 'on'} "
                f"(torch.set_grad_enabled); flatfl turned them {'on' if grad else 'off'} again")
    try:
        moved = cwd is not None and os.getcwd() != cwd
    except OSError:  # your code removed the folder it moved to
        moved = cwd is not None
    if moved:
        try:
            os.chdir(cwd)
            _notice("working directory", f"{what} changed the working directory; flatfl changed it back to "
                    f"{cwd}, where the command's relative paths (--out) point")
        except OSError:
            pass


def guard_forward(module, what: str):
    """``module`` (a network of yours) with every call of it, its ``forward`` and hooks, run in :func:`user_code`:
    a forward pre-hook begins the block and a forward hook that torch calls even when the forward raises ends it.
    Returns ``module``."""
    blocks: list = []  # one per call under way (a network may call itself)

    def begin(_module, _args):
        block = user_code(what)
        block.__enter__()
        blocks.append(block)

    def end(_module, _args, _output):
        if blocks:
            blocks.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(begin, prepend=True)
    module.register_forward_hook(end, always_call=True)
    return module


def guarded(fn: Callable, what: str) -> Callable:
    """``fn`` (a function of yours) with every call run in :func:`user_code`; its name, module, signature and
    docstring are ``fn``'s (``functools.wraps``)."""
    import functools

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with user_code(what):
            return fn(*args, **kwargs)

    return call
