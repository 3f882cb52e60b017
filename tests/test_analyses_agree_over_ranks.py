"""`flatfl hessian-clients` and `flatfl surface` hand what they loaded to the ranks' agreement
(:func:`flatfl.utils.ranks.agree`, whose refusals tests/test_rank_agreement.py checks over 2 ranks) before any work:
the data and the weights, as a digest that changes with them, computed only over several ranks (a function the
agreement calls). In one process the agreement is a no-op; here it is recorded and its record computed."""
from __future__ import annotations

from click.testing import CliRunner

from flatfl.cli import main
from flatfl.utils import ranks
from tiny_run import train_tiny


def test_clients_and_surface_submit_their_data_and_weights(tmp_path, monkeypatch):
    run = train_tiny(tmp_path / "run", "--save-clients")
    seen = []
    monkeypatch.setattr(ranks, "agree", lambda record: seen.append(dict(record())))
    r = CliRunner().invoke(main, ["hessian-clients", str(run), "--probes", "4", "--groups", "2", "--samples", "16",
                                  "--quiet", "--out", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["surface", str(run), "--grid", "2", "--samples", "16", "--quiet",
                                  "--out", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    clients = next(rec for rec in seen if "client models" in rec)
    surface = next(rec for rec in seen if "evaluation data" in rec and "client models" not in rec)
    assert set(clients) == {"training data", "weights", "client models"}
    assert set(surface) == {"evaluation data", "weights"}
    # the digests are of what was loaded: other samples give another evaluation-data digest
    r = CliRunner().invoke(main, ["surface", str(run), "--grid", "2", "--samples", "17", "--quiet",
                                  "--out", str(tmp_path / "s2")])
    assert r.exit_code == 0, r.output
    assert seen[-1]["evaluation data"] != surface["evaluation data"] and seen[-1]["weights"] == surface["weights"]
