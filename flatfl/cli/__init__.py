"""The ``flatfl`` command line. Each command parses its options and calls one library function; the commands are
grouped by job: :mod:`~flatfl.cli.train_commands` (train, partition, algos, models),
:mod:`~flatfl.cli.analysis_commands` (hessian, hessian-clients, surface), :mod:`~flatfl.cli.report_commands`
(report, contrast, reproduce, sweep); what they share is :mod:`~flatfl.cli.common`.

Errors caused by the user's input are :class:`flatfl.errors.FlatflError`; they are printed as one line
(``flatfl: error: ...``) with exit status 2, never as a traceback.
"""
from __future__ import annotations

import os
import sys

from ..utils.startup import install_interrupt_hook

if os.path.basename(sys.argv[0] or "") == "flatfl":  # the console script: Ctrl-C while starting gives one line
    install_interrupt_hook()

import click  # noqa: E402

from . import analysis_commands, report_commands, train_commands  # noqa: E402
from .common import FlatflGroup  # noqa: E402

__all__ = ["main"]


@click.group(cls=FlatflGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="flatfl")
def main() -> None:
    """flatfl: federated learning with flatness regularizers, and the curvature of what it learns."""


for _module in (train_commands, analysis_commands, report_commands):
    for _name in _module.__all__:
        _command = getattr(_module, _name)
        if isinstance(_command, click.Command):
            main.add_command(_command)
