"""One small trained run through the command line, the checkpoint the analysis tests measure: the tiny network on
the embedded digits, 1 round, 2 clients, 1 local epoch, batches of 64."""
from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from flatfl.cli import main


def train_tiny(out: Path, *flags: str) -> Path:
    """Train the tiny run into ``out`` (``flags``: more ``flatfl train`` options) and return ``out``."""
    r = CliRunner().invoke(main, ["train", "--dataset", "digits", "--model", "tiny", "--rounds", "1", "--clients",
                                  "2", "--local-epochs", "1", "--batch-size", "64", "--quiet", *flags,
                                  "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return out


def analyse_tiny(run: Path, out: Path, *flags: str) -> tuple:
    """``flatfl hessian RUN --quiet --threads 1 --out OUT [flags]``: the click result and, when it succeeded, the
    hessian.json it wrote (None otherwise)."""
    import json

    r = CliRunner().invoke(main, ["hessian", str(run), "--quiet", "--threads", "1", "--out", str(out), *flags])
    return r, (json.loads((out / "hessian.json").read_text()) if r.exit_code == 0 else None)
