"""One run identity (:mod:`flatfl.utils.run_identity`, :mod:`flatfl.train.identity`): every RunConfig field is
classified, as deciding the numbers or not, and the readers agree on the same pair of configs: resuming a run
(``--resume``), a sweep finding a run folder (``run_state``) and a report averaging runs as seeds of one experiment
(``training_settings``)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flatfl.errors import ConfigError
from flatfl.report.experiments import training_settings
from flatfl.sweep import run_state
from flatfl.train.config import RunConfig
from flatfl.train.engine import Trainer
from flatfl.train.identity import experiment_settings, run_settings
from flatfl.train.train_command import RESUME_FLAGS
from flatfl.utils.provenance import differing_settings
from flatfl.utils.run_identity import NO_NUMBER_SETTINGS, RESUMABLE_CHANGES, differing_keys

#: the RunConfig fields that decide a run's numbers (with the seed). A new field of RunConfig goes either here or
#: into flatfl.utils.run_identity's lists, chosen consciously: the first test fails until it is in one of them.
DECIDES_NUMBERS = ("dataset", "model", "model_args", "augment", "partition", "alpha", "clients", "rounds",
                   "participation", "sampling", "local_epochs", "batch_size", "lr", "lr_decay", "weight_decay",
                   "momentum", "nesterov", "clip", "algo", "local_opt", "reg", "params", "seed", "float32_matmul",
                   "precision")
#: settings of NO_NUMBER_SETTINGS that are no RunConfig field: recorded by earlier versions' config.json
RECORDED_BY_EARLIER_VERSIONS = {"quiet"}

TINY = dict(dataset="digits", model="tiny", clients=4, participation=1.0, local_epochs=1, batch_size=50, rounds=2,
            eval_every=1, checkpoint_every=1, threads=1, seed=0)


def test_every_run_config_field_is_classified():
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    decides, neutral = set(DECIDES_NUMBERS), set(NO_NUMBER_SETTINGS)
    assert not decides & neutral, f"in both lists: {sorted(decides & neutral)}"
    unclassified = fields - decides - neutral
    assert not unclassified, (f"RunConfig fields in no list: {sorted(unclassified)}; add each to DECIDES_NUMBERS "
                              "here or to flatfl.utils.run_identity (WHERE_IT_RAN / WHAT_IT_RECORDS)")
    assert decides <= fields, f"no longer RunConfig fields: {sorted(decides - fields)}"
    assert neutral - fields == RECORDED_BY_EARLIER_VERSIONS
    assert set(RESUMABLE_CHANGES) <= neutral  # what a resumption may change changes no number
    assert set(RESUME_FLAGS) <= set(RESUMABLE_CHANGES)  # --resume's own flags are among them


def test_identity_functions_keep_exactly_the_classified_settings():
    """run_settings: all but what a resumption may change; experiment_settings: what decides the numbers, less the
    seed (the network by its resolved name, the pieces' hyper-parameters at their values or defaults)."""
    config = RunConfig(**TINY).validate().to_dict()
    assert set(run_settings(config)) == set(config) - set(RESUMABLE_CHANGES)
    experiment = experiment_settings(config)
    assert {k for k in experiment if not k.startswith("params.")} == set(DECIDES_NUMBERS) - {"seed", "params"}


# ------------------------------------------------------------------------- the readers agree on one pair of configs
@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _killed_run(run_dir, crash_in_round) -> RunConfig:
    """A run of TINY killed in its second round (its resume.pt at round 1); its config."""
    cfg = RunConfig(**TINY, out=str(run_dir)).validate()
    with crash_in_round(1), pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(cfg, run_dir, quiet=True).run()
    return cfg


# (changed setting, its new value, resume and sweep accept it, the report counts the two as one experiment)
PAIRS = [("threads", 2, True, True), ("parallel_clients", 2, True, True), ("lr", 0.05, False, False),
         ("eval_every", 2, False, True), ("precision", "float64", False, False)]


@pytest.mark.parametrize("key, value, resumable, same_experiment", PAIRS, ids=[p[0] for p in PAIRS])
def test_resume_sweep_and_report_agree(tmp_path, crash_in_round, threads_restored, key, value, resumable,
                                       same_experiment):
    run_dir = tmp_path / "run"
    cfg = _killed_run(run_dir, crash_in_round)
    other = dataclasses.replace(cfg, **{key: value}).validate()
    a, b = cfg.to_dict(), other.to_dict()
    assert (key in RESUMABLE_CHANGES) == resumable and (key in NO_NUMBER_SETTINGS) == same_experiment
    # the identity functions
    assert differing_keys(run_settings(a), run_settings(b)) == ([] if resumable else [key])
    assert differing_keys(experiment_settings(a), experiment_settings(b)) == ([] if same_experiment else [key])
    assert differing_settings(a, b) == ([] if same_experiment else [key])
    # the report: seeds of one experiment, or two experiments differing in this setting
    assert differing_keys(training_settings(a), training_settings(b)) == ([] if same_experiment else [key])
    # a sweep that finds the folder
    if resumable:
        assert run_state(run_dir, expected=other) == "partial"
    else:
        with pytest.raises(ConfigError, match=f"holds a run with other settings \\({key}: "):
            run_state(run_dir, expected=other)
    # --resume
    if resumable:
        final = Trainer(other, run_dir, resume=True, quiet=True).run()
        assert final.is_file() and torch.load(final, weights_only=True)["round"] == 2
    else:
        with pytest.raises(ConfigError) as e:
            Trainer(other, run_dir, resume=True, quiet=True)
        message = str(e.value)
        assert len(message.splitlines()) == 1 and f"({key}: " in message and "changed since the run started" in message
