"""What every command of the command line shares: errors as one line (:func:`friendly_errors`, :class:`FlatflGroup`),
the ranks of a distributed command meeting before its work (:func:`meet_other_ranks`, :func:`rank_record`), an end
that waits for no thread of your code (:func:`finish`), names checked with a suggestion (:class:`NameChoice`) and the
``--threads`` option.

Errors caused by the user's input are :class:`flatfl.errors.FlatflError`; they are printed as one line
(``flatfl: error: ...``) with exit status 2, never as a traceback.
"""
from __future__ import annotations

import functools
import os
import sys

import click

from ..errors import FlatflError, error_line, raised_in, unknown_name, user_frame, users_file
from ..utils.startup import import_torch_uninterruptibly, settle_source_date_epoch

__all__ = ["friendly_errors", "describe_failure", "autograd_backward_frame", "interrupted_line", "meet_other_ranks",
           "rank_record", "finish", "quiet_torch_logs", "FlatflGroup", "LazyHelp", "NameChoice", "THREADS_HELP",
           "RANK_OWN_OPTIONS", "RESUMED_FILES", "threads_option", "apply_threads"]


def friendly_errors(fn):
    """Turn FlatflError (and a few well-known OS errors) into one line on stderr and exit status 2. Under several
    ranks the command first meets the other ranks (:func:`meet_other_ranks`), and a rank's own error is told to the
    others, so that the user reads it once, from rank 0 (docs/distributed.md)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from ..utils import ranks

        try:
            meet_other_ranks()
            result = fn(*args, **kwargs)
            ranks.leave()  # under torchrun: every rank waits until rank 0 has written its files
            return result
        except ranks.RankFailed as e:  # another rank's own error: rank 0 says it, as that rank said it
            _end(f"flatfl: error: {error_line(e)}", e.code)
        except ranks.RankStopped as e:
            _end_after_another_rank(f"flatfl: error: {error_line(e)}", 2)
        except FlatflError as e:
            # the same input error on every rank: rank 0 says it; an error of this rank's own that it cannot tell
            # rank 0 (an error naming it, before the ranks met) it says itself
            _end_with_own_error(error_line(e), 2, alone=_names_this_rank(error_line(e)))
        except KeyboardInterrupt as e:
            where = None if getattr(e, "hint", None) else user_frame(e, innermost=True)
            if where:  # raised by (or while) code of yours (a loss, a network, a plug-in) ran: named
                e.hint = f"in your code, {where}; {INTERRUPTED.split('; ', 1)[1]}"
            _end(interrupted_line(e), 130)
        except SystemExit as e:  # flatfl's own exits go on; one from user or plug-in code is an error, never 0
            where = raised_in(e)
            if where is None:
                raise
            _end_with_own_error(f"{where} called sys.exit({e.code!r}) while flatfl ran it; the command did not "
                                "finish (nothing half-written was kept)", 2, alone=True)
        except Exception as e:  # no traceback for the user: one line, exit 1 (FLATFL_DEBUG=1 shows it)
            peer = ranks.peer_failure(e)
            if peer is not None:  # a collective failed because another rank stopped
                _end_after_another_rank(f"flatfl: error: {peer}", 1)
            if os.environ.get("FLATFL_DEBUG"):
                raise
            own = isinstance(e, (OSError, UnicodeDecodeError, ValueError)) or autograd_backward_frame(e) is not None
            _end_with_own_error(error_line(describe_failure(e)), 2 if own else 1, alone=True)

    return wrapper


def _names_this_rank(line: str) -> bool:
    """Whether ``line`` begins by naming this rank ('rank R ...', an error of this rank's own), under several ranks."""
    from ..utils import ranks

    try:
        w = ranks.launched()
    except FlatflError:
        return False
    return w.distributed and (line.startswith(f"rank {w.rank} ") or line.startswith(f"rank {w.rank}:"))


def _end(line: str, code: int, everywhere: bool = False) -> None:
    """Say ``line`` (rank 0, or every rank with ``everywhere``), end this rank's part of the run, exit ``code``."""
    from ..utils import ranks

    _say(line, everywhere=everywhere)
    ranks.end_with_error()
    sys.exit(code)


def _end_with_own_error(line: str, code: int, alone: bool) -> None:
    """This rank's own error: told to the other ranks (rank 0 says it when it is another rank's); said by this rank
    when it is rank 0, or when it cannot be told and is this rank's alone (``alone``)."""
    from ..utils import ranks

    told = ranks.tell_others(line, code)
    _end(f"flatfl: error: {line}", code, everywhere=alone and not told)


def _end_after_another_rank(line: str, code: int) -> None:
    """A collective broke, or torchrun stopped this rank, because another rank stopped: the error that rank told, said
    by rank 0 alone with its exit status; else ``line`` from every rank (a rank killed tells nothing)."""
    from ..utils import ranks

    told = ranks.told_failure()
    if told is not None:
        _end(f"flatfl: error: {error_line(told)}", told.code)
    _end(line, code, everywhere=True)


def meet_other_ranks() -> None:
    """Under several ranks, before the command's own work: every rank's record of its command (:func:`rank_record`)
    compared with the others' (:func:`flatfl.utils.ranks.meet`); nothing in one process."""
    from ..utils import ranks

    if not ranks.launched().distributed:
        return
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.command is not None:
        ranks.meet(rank_record(ctx))


#: options that change no number and may differ from rank to rank: a rank's threads, whether it shows progress
RANK_OWN_OPTIONS = ("threads", "quiet")


def rank_record(ctx: click.Context) -> dict:
    """What the ranks of one command must share, as JSON values by name: the command, each setting as parsed (but
    :data:`RANK_OWN_OPTIONS`), flatfl's and torch's versions, and the SHA-256 of each file a setting names (the
    checkpoint a run folder stands for, a resumed run's state, a config file, your code in ``file.py:function``)."""
    import torch

    from ..version import __version__

    record = {"command": ctx.command.name, "flatfl version": __version__, "torch version": torch.__version__}
    files = {}
    for param in ctx.command.get_params(ctx):
        name = param.name
        if name is None or name in RANK_OWN_OPTIONS or name not in ctx.params:
            continue
        label = param.opts[0] if param.opts else name
        if isinstance(param, click.Argument):
            label = name.upper()
        value = ctx.params[name]
        record[label] = list(value) if isinstance(value, tuple) else value
        digest = _named_file_digest(name, value)
        if digest is not None:
            files[f"{label} (contents)"] = digest
    record.update(files)
    return record


#: the files of a run that ``train --resume`` reads
RESUMED_FILES = ("config.json", "resume.pt", "partition.json", "data.pt")


def _named_file_digest(name: str, value) -> str | None:
    """SHA-256 of what setting ``name`` = ``value`` reads, when it names files: the checkpoint (a run folder: its
    final.pt), a resumed run's state, a config or eigenvector file, your code's file (``file.py:function``);
    'missing' for a checkpoint that is not there (the command says so on every rank). None for anything else."""
    from pathlib import Path

    if not isinstance(value, str) or not value:
        return None
    if name == "checkpoint":
        from ..checkpoint import resolve_checkpoint_path

        try:
            return _file_digest([resolve_checkpoint_path(value)])
        except (FlatflError, OSError):
            return "missing"
    if name == "resume_dir":
        return _file_digest([Path(value) / f for f in RESUMED_FILES])
    if ":" in value and value.rsplit(":", 1)[0].endswith(".py"):  # your code: --loss, --model-factory
        value = value.rsplit(":", 1)[0]
    path = Path(value).expanduser()
    return _file_digest([path]) if path.is_file() else None


def _file_digest(paths) -> str:
    """The first 16 hex digits of the SHA-256 of the files ``paths`` (each name and contents; one that is missing or
    not a regular file as such), read in blocks."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    for path in map(Path, paths):
        h.update(str(path.name).encode() + b"\0")
        try:
            if not path.is_file():  # missing, a folder, a pipe or a device: never opened (a pipe would block)
                h.update(b"(not a file)")
                continue
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        except OSError as e:
            h.update(f"(unreadable: {e.strerror})".encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


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
    backward = autograd_backward_frame(e)
    if backward is not None:  # your Function's backward, run by torch's backward pass: it may lack a second one
        return (f"{type(e).__name__} in your code, {backward}: {text or type(e).__name__}; it was raised in the "
                "backward of your torch.autograd.Function, which exact Hessian products differentiate again (double "
                "backward): for a Function without a second derivative, compute the products from first derivatives "
                "only with --products finite-difference (flatfl hessian)")
    if isinstance(e, ValueError) and "closed file" in text and _closed_stream() is not None:
        return (f"sys.{_closed_stream()} was closed by code flatfl ran (yours: a loss, network, factory or plug-in), "
                "so flatfl could not print to it; leave the standard streams open")
    where = user_frame(e)  # raised in (or under) your own code: named, not blamed on the data
    if isinstance(e, ValueError):
        return f"{type(e).__name__} in your code, {where}: {text or type(e).__name__}" if where else \
            f"invalid data: {text or type(e).__name__}"
    place = f", raised in your code at {where}" if where else ""
    return f"internal error {type(e).__name__}: {text} (set FLATFL_DEBUG=1 for the traceback{place})"


def autograd_backward_frame(e: BaseException) -> str | None:
    """``Function.backward (file:line)`` when ``e`` was raised by the ``backward`` (or ``vjp``) of a
    ``torch.autograd.Function`` of yours while torch's backward pass ran it; None otherwise."""
    tb, engine, found = e.__traceback__, False, None
    while tb is not None:
        code = tb.tb_frame.f_code
        path = os.path.normpath(code.co_filename)
        if os.sep.join(("torch", "autograd")) in path:
            engine = True
        elif engine and code.co_name in ("backward", "vjp") and "ctx" in code.co_varnames[:1]:
            qualname = getattr(code, "co_qualname", code.co_name)
            found = f"{qualname} ({code.co_filename}:{tb.tb_lineno})"
        tb = tb.tb_next
    return found if found is not None and user_frame(e, innermost=True) is not None else None


def _closed_stream() -> str | None:
    """'stdout' or 'stderr' when that standard stream is closed."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        if stream is not None and getattr(stream, "closed", False):
            return name
    return None


class FlatflGroup(click.Group):
    """click's group, with its usage errors (a bad flag value, an unknown option) also on one line. Run as the
    command line itself (no ``args`` given), it ends once its result line is out, whatever threads your code left
    running (:func:`finish`)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        import threading

        before = set(threading.enumerate())
        try:
            self.run_command(args, prog_name, complete_var, **extra)
        except SystemExit as e:
            finish(e.code, before, process=args is None)
        finish(0, before, process=args is None)

    def run_command(self, args, prog_name, complete_var, **extra) -> None:
        """Parse and run the command, every ending an exit (SystemExit) with one line for an error."""
        argv = sys.argv[1:] if args is None else list(args)
        try:
            if argv and not {"-h", "--help", "--version"} & set(argv):
                problem = settle_source_date_epoch()  # before numpy's f2py (read by scipy's import) sees it
                if problem:
                    click.echo(f"flatfl: error: {problem}", err=True)
                    sys.exit(2)
                quiet_torch_logs()
                import_torch_uninterruptibly()  # a command will run: torch first, Ctrl-C held back meanwhile
                _under_torchrun(argv)
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except (click.exceptions.Abort, KeyboardInterrupt) as e:
            click.echo(interrupted_line(e) if getattr(e, "hint", None) else "flatfl: interrupted", err=True)
            sys.exit(130)
        except click.ClickException as e:
            where = e.ctx.command_path if getattr(e, "ctx", None) is not None else "flatfl"
            hint = f" (see '{where} --help')" if isinstance(e, click.UsageError) else ""
            line = error_line(' '.join(e.format_message().split())) + hint
            _tell_ranks_of_usage_error(argv, line)
            click.echo(f"flatfl: error: {line}", err=True)
            sys.exit(e.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)


def finish(code, before: set, process: bool) -> None:
    """Exit with ``code``. In the command-line process (``process``), threads that code flatfl ran (your loss,
    network, factory or plug-in) started and left running, not daemons, would keep it alive after its result line:
    they are named in one line and the process ends without waiting for them (its output flushed first)."""
    import threading

    stray = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon
             and t is not threading.main_thread() and _run_by_your_code(t)]
    if not process or not stray or not (code is None or isinstance(code, int)):
        sys.exit(code)
    from ..utils import ranks

    names = ", ".join(t.name for t in stray[:3]) + (" ..." if len(stray) > 3 else "")
    many = len(stray) > 1
    if ranks.is_main():
        try:
            click.echo(f"flatfl: notice: code flatfl ran (yours: a loss, network, factory or plug-in) left "
                       f"{len(stray)} thread{'s' if many else ''} running ({names}); flatfl ends without waiting "
                       f"for {'them' if many else 'it'}", file=ranks.error_stream())
        except (OSError, ValueError):
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(0 if code is None else int(code))


def _run_by_your_code(thread) -> bool:
    """Whether ``thread`` runs code of yours (:func:`flatfl.errors.users_file`): its ``run`` method, or the function
    it was given, when that is Python code; a built-in function (``time.sleep``) counts as yours, since neither
    flatfl nor the libraries it uses start threads that run one and never end."""
    import threading

    run = type(thread).run
    fn = vars(thread).get("_target") if run is threading.Thread.run else run
    code = getattr(fn, "__code__", None)
    return code is None or users_file(code.co_filename)


def quiet_torch_logs() -> None:
    """Under several ranks, torch's C++ log lines (a rank's connection retries, gloo's own reports) are kept off the
    terminal, where flatfl says what went wrong in one line; ``TORCH_CPP_LOG_LEVEL`` set by you, or
    ``FLATFL_DEBUG=1``, keeps them. Before torch is imported (it reads the variable then)."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ or os.environ.get("FLATFL_DEBUG"):
        return
    if os.environ.get("WORLD_SIZE", "").strip() not in ("", "0", "1"):
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"


def _tell_ranks_of_usage_error(argv: list[str], line: str) -> None:
    """Under several ranks, a command line this rank cannot parse is its error at the ranks' meeting: the ranks that
    could parse theirs then end too, rank 0 saying this rank's line (:func:`flatfl.utils.ranks.meet`)."""
    from ..utils import ranks

    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        if command not in SPLIT_COMMANDS or not ranks.launched().distributed:
            return
        ranks.meet({"error": line})
    except FlatflError:
        pass
    ranks.end_with_error()


#: the commands that split their work over the ranks of a torchrun launch (docs/distributed.md); any other
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
    except FlatflError as e:  # the same environment on every rank: rank 0 says it (a rank's own RANK, that rank)
        rank = os.environ.get("RANK", "").strip()
        if not rank.isdigit() or int(rank) == 0 or "RANK=" in str(e).replace("WORLD_SIZE=", ""):
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
