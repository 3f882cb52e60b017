"""Which rank writes an analysis command's files is decided in one place, the command's world
(flatfl/analysis/commands/skeleton.py): on rank 0 (or the only process) every file is written and every figure
drawn; on any other rank nothing is written and no figure is drawn. The independent truth: the folder on disk and
which drawing functions were called."""
from __future__ import annotations

import json

import pytest
import torch

from flatfl.analysis.commands.skeleton import AnalysisCommand
from flatfl.utils.ranks import World


@pytest.mark.parametrize("world,writes", [(World(), True), (World(rank=0, size=2), True),
                                          (World(rank=1, size=2), False), (World(rank=2, size=3), False)])
def test_only_the_writing_rank_draws_and_writes(tmp_path, world, writes):
    out = tmp_path / "out"
    drawn = []

    def figure():
        drawn.append("figure.png")
        return b"png bytes"

    cmd = AnalysisCommand(out, torch.device("cpu"), checkpoint=None, world=world)
    assert cmd.writes is writes
    written = cmd.write({"figure.png": figure, "table.csv": "a,b\n1,2\n"}, "result.json", {"value": 1.5})
    ran = cmd.run_writer(lambda path: (path.write_text("own writer"), "wrote")[1], out / "extra.txt")
    if writes:
        assert drawn == ["figure.png"] and ran == "wrote"
        assert {p.name for p in out.iterdir()} >= {"extra.txt", "figure.png", "result.json", "table.csv"}
        assert (out / "figure.png").read_bytes() == b"png bytes" and (out / "table.csv").read_text() == "a,b\n1,2\n"
        assert json.loads((out / "result.json").read_text()) == {"value": 1.5}
        assert set(written) == {out / "figure.png", out / "table.csv", out / "result.json"}
    else:
        assert drawn == [] and ran is None and written == {} and not out.exists()
