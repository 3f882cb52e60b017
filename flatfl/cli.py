"""The ``flatfl`` command line. Each command parses its options and calls one library function.

Errors caused by the user's input are :class:`flatfl.errors.FlatflError`; they are printed as one line
(``flatfl: error: ...``) with exit status 2, never as a traceback.
"""
from __future__ import annotations

import functools
import sys

import click

from .errors import FlatflError


def friendly_errors(fn):
    """Turn FlatflError (and a few well-known OS errors) into one line on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FlatflError as e:
            click.echo(f"flatfl: error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("flatfl: interrupted", err=True)
            sys.exit(130)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="flatfl")
def main() -> None:
    """flatfl: federated learning with flatness regularizers, and the curvature of what it learns."""
