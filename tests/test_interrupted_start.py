"""A run stopped between claiming its config.json in the folder's manifest and moving the file into place (Ctrl-C at
that instant) leaves its lock and a manifest that lists a file which is not there: the same command then starts the
run afresh, from the sweep (`run_state` 'new') and from `flatfl train`, instead of calling the folder someone else's."""
from __future__ import annotations

import json

from click.testing import CliRunner

from flatfl.cli import main
from flatfl.sweep import run_state
from flatfl.utils.lock import LOCK_NAME
from flatfl.utils.manifest import MANIFEST


def _stopped_before_config(folder):
    folder.mkdir(parents=True)
    (folder / LOCK_NAME).write_text("12345\n")
    (folder / MANIFEST).write_text(json.dumps({"format": "flatfl-manifest", "files": ["config.json"],
                                               "sha256": {"config.json": "0" * 64}}))


def test_a_run_stopped_before_its_config_starts_again(tmp_path):
    run = tmp_path / "run"
    _stopped_before_config(run)
    assert run_state(run) == "new"
    r = CliRunner().invoke(main, ["train", "--dataset", "digits", "--model", "tiny", "--rounds", "1", "--clients", "2",
                                  "--local-epochs", "1", "--quiet", "--out", str(run)])
    assert r.exit_code == 0, r.output
    assert (run / "config.json").is_file() and (run / "final.pt").is_file()


def test_a_folder_with_a_file_of_its_own_is_still_refused(tmp_path):
    run = tmp_path / "run"
    _stopped_before_config(run)
    (run / "notes.txt").write_text("mine")
    r = CliRunner().invoke(main, ["train", "--dataset", "digits", "--model", "tiny", "--rounds", "1", "--clients", "2",
                                  "--quiet", "--out", str(run)])
    assert r.exit_code != 0 and "already exists" in r.output
    assert (run / "notes.txt").read_text() == "mine"
