"""What every command of the command line shares: errors as one line (:func:`friendly_errors`, :class:`FlatflGroup`),
names checked with a suggestion (:class:`NameChoice`) and the ``--threads`` option.

Errors caused by the user's input are :class:`flatfl.errors.FlatflError`; they are printed as one line
(``flatfl: error: ...``) with exit status 2, never as a traceback.
"""
from __future__ import annotations

import functools
import os
import sys

import click

from ..errors import FlatflError, error_line, raised_in, unknown_name, user_frame
from ..utils.startup import import_torch_uninterruptibly, settle_source_date_epoch

__all__ = ["friendly_errors", "describe_failure", "interrupted_line", "FlatflGroup", "LazyHelp", "NameChoice", "THREADS_HELP",
           "threads_option", "apply_threads"]


def friendly_errors(fn):
    """Turn FlatflError (and a few well-known OS errors) into one line on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from ..utils import ranks

        try:
            result = fn(*args, **kwargs)
            ranks.leave()  # under torchrun: every rank waits until rank 0 has written its files
            return result
        except FlatflError as e:
            # the same input error on every rank: rank 0 says it (another rank's own error is said by that rank)
            _say(f"flatfl: error: {error_line(e)}", everywhere=isinstance(e, ranks.RankStopped))
            sys.exit(2)
        except KeyboardInterrupt as e:
            where = None if getattr(e, "hint", None) else user_frame(e, innermost=True)
            if where:  # raised by (or while) code of yours (a loss, a network, a plug-in) ran: named
                e.hint = f"in your code, {where}; {INTERRUPTED.split('; ', 1)[1]}"
            _say(interrupted_line(e))
            sys.exit(130)
        except SystemExit as e:  # flatfl's own exits go on; one from user or plug-in code is an error, never 0
            where = raised_in(e)
            if where is None:
                raise
            _say(f"flatfl: error: {where} called sys.exit({e.code!r}) while flatfl ran it; the command did "
                 "not finish (nothing half-written was kept)")
            sys.exit(2)
        except Exception as e:  # no traceback for the user: one line, exit 1 (FLATFL_DEBUG=1 shows it)
            peer = ranks.peer_failure(e)
            if peer is not None:  # a collective failed because another rank stopped
                _say(f"flatfl: error: {peer}", everywhere=True)
                sys.exit(1)
            if os.environ.get("FLATFL_DEBUG"):
                raise
            _say(f"flatfl: error: {error_line(describe_failure(e))}", everywhere=True)
            sys.exit(2 if isinstance(e, (OSError, UnicodeDecodeError, ValueError)) else 1)

    return wrapper


def _say(line: str, everywhere: bool = False) -> None:
    """An error line on the terminal: from rank 0 (the only process, without torchrun), and from every rank when
    ``everywhere`` (an error of that rank's own)."""
    from ..utils import ranks

    if everywhere or ranks.is_main():
        click.echo(line, file=ranks.error_stream())


#: what Ctrl-C leaves, when the command says nothing more precise (every output is written atomically)
INTERRUPTED = "interrupted; nothing half-written was kept, run the same command again"


def interrupted_line(e: BaseException | None = None) -> str:
    """The one line for Ctrl-C: 'flatfl: interrupted; ' and what was kept and how to go on, from the exception's
    ``hint`` attribute when the command set one (``train``, ``sweep``, ``reproduce``), else :data:`INTERRUPTED`."""
    hint = getattr(e, "hint", None)
    return f"flatfl: interrupted; {hint}" if isinstance(hint, str) and hint else f"flatfl: {INTERRUPTED}"


def describe_failure(e: BaseException) -> str:
    """One line for an exception that is not a FlatflError (disk full, unreadable file, corrupt data...)."""
    import errno

    if isinstance(e, OSError):
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        if e.errno == errno.ENOSPC:
            return f"no space left on device{where}: nothing half-written was kept; free space and run again"
        return f"{e.strerror or type(e).__name__}{where}"
    if isinstance(e, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({e.reason} at byte {e.start})"
    text = " ".join(str(e).split())[:200]
    where = user_frame(e)  # raised in (or under) your own code: named, not blamed on the data
    if isinstance(e, ValueError):
        return f"{type(e).__name__} in your code, {where}: {text or type(e).__name__}" if where else \
            f"invalid data: {text or type(e).__name__}"
    place = f", raised in your code at {where}" if where else ""
    return f"internal error {type(e).__name__}: {text} (set FLATFL_DEBUG=1 for the traceback{place})"


class FlatflGroup(click.Group):
    """click's group, with its usage errors (a bad flag value, an unknown option) also on one line."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        argv = sys.argv[1:] if args is None else list(args)
        try:
            if argv and not {"-h", "--help", "--version"} & set(argv):
                problem = settle_source_date_epoch()  # before numpy's f2py (read by scipy's import) sees it
                if problem:
                    click.echo(f"flatfl: error: {problem}", err=True)
                    sys.exit(2)
                import_torch_uninterruptibly()  # a command will run: torch first, Ctrl-C held back meanwhile
                _under_torchrun(argv)
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except (click.exceptions.Abort, KeyboardInterrupt) as e:
            click.echo(interrupted_line(e) if getattr(e, "hint", None) else "flatfl: interrupted", err=True)
            sys.exit(130)
        except click.ClickException as e:
            where = e.ctx.command_path if getattr(e, "ctx", None) is not None else "flatfl"
            hint = f" (see '{where} --help')" if isinstance(e, click.UsageError) else ""
            click.echo(f"flatfl: error: {error_line(' '.join(e.format_message().split()))}{hint}", err=True)
            sys.exit(e.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)


#: the commands that split their work over the ranks of a torchrun launch (docs/ranks.md); any other
#: command runs on rank 0 alone, as one process, and the other ranks end at once
SPLIT_COMMANDS = ("train", "hessian", "hessian-clients", "surface")
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _under_torchrun(argv: list[str]) -> None:
    """Under torchrun with several ranks: the other ranks print nothing but their errors; a command that does not
    split its work runs on rank 0 as one process (its own workers, a sweep's, must not join the ranks), the others
    end here."""
    from ..utils import ranks

    try:
        w = ranks.launched()
    except FlatflError as e:
        click.echo(f"flatfl: error: {error_line(e)}", err=True)
        sys.exit(2)
    if not w.distributed:
        return
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in SPLIT_COMMANDS:
        ranks.quiet_other_ranks()
        return
    if not w.main:
        sys.exit(0)
    for name in _TORCHRUN_VARIABLES:
        os.environ.pop(name, None)


THREADS_HELP = ("torch threads, an integer >= 1 (default: 1 on machines with <= 2 cores, else the idle cores: "
                "cores minus the busy ones, from the 1-minute load average and the current use)")


def threads_option(fn):
    """The ``--threads`` option."""
    return click.option("--threads", type=int, default=None, help=THREADS_HELP)(fn)


def apply_threads(threads) -> int:
    """Set torch's threads (``None``: the default for this machine); returns the count."""
    from ..utils.threads import apply_threads

    return apply_threads(threads)


class LazyHelp(click.Option):
    """An option whose help text is computed when help is shown (``lazy_help``, a function of no argument): the
    estimators' names come from plug-ins, which load only then, not for every command."""

    def __init__(self, *args, lazy_help, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_help = lazy_help

    def get_help_record(self, ctx):
        self.help = self.lazy_help()
        return super().get_help_record(ctx)


class NameChoice(click.Choice):
    """click's Choice whose error names the closest valid value in one line, as every other unknown name does
    (:func:`flatfl.errors.unknown_name`): ``unknown partition 'iidd'. Did you mean 'iid'?``."""

    def __init__(self, choices, kind: str | None = None, **kwargs):
        super().__init__(list(choices), **kwargs)
        self.kind = kind

    def convert(self, value, param, ctx):
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            kind = self.kind or (param.name.replace("_", " ") if param is not None and param.name else "value")
            self.fail(str(unknown_name(kind, value, self.choices)), param, ctx)
