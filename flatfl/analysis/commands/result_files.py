"""One reader per result file the analyses write, so that every reader (the commands themselves, ``runs``,
``report``) reads them alike.

* :func:`read_hessian_file`: ``hessian.json`` of ``flatfl hessian``;
* :func:`read_clients_file`: ``clients-<protocol>.json`` of ``flatfl hessian-clients`` (:func:`clients_file`
  names it);
* :func:`read_surface_file`: ``surface.json`` of ``flatfl surface``.

Each returns None when the file does not exist and the file's JSON object otherwise, its fields that readers use
checked for type, and the numbers readers compute with (eigenvalues, their residuals and errors, the trace, the
density, H_N and H_D) checked for range: finite and within +-:data:`MAX_MAGNITUDE`. Anything else (not JSON, not an
object, a field of another type, a number out of range: a file flatfl did not write) is one
:class:`ResultFileError` line naming the file and the field. Callers that recompute a damaged result catch it; the
others show it."""
from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Mapping

from ...errors import ConfigError

__all__ = ["ResultFileError", "read_result_file", "read_hessian_file", "read_clients_file", "read_surface_file",
           "clients_file", "HESSIAN_FIELDS", "CLIENTS_FIELDS", "SURFACE_FIELDS", "first_out_of_range", "MAX_MAGNITUDE"]


class ResultFileError(ConfigError):
    """A result file that is not what its name says (not JSON, not an object, a field of another type)."""


_NUMBER = (numbers.Real,)
# field -> the types it may have (None is always allowed: older files lack fields)
HESSIAN_FIELDS = {"checkpoint": (str,), "round": (int,), "weights_sha256": (str,), "num_samples": (int,),
                  "top_eigenvalues": (list,), "residuals": (list,), "error_estimates": (list,), "trace": (dict,),
                  "density": (dict,), "settings": (dict,), "clients": (dict,), "curvature": (str,),
                  "measured": (str,), "samples": (dict,), "smallest_eigenvalues": (dict,),
                  "quantities": (dict,)}
CLIENTS_FIELDS = {"protocol": (str,), "H_N": _NUMBER, "H_D": _NUMBER, "H_N_stderr": _NUMBER, "H_D_stderr": _NUMBER,
                  "settings": (dict,), "round": (int,), "weights_sha256": (str,), "checkpoint": (str,)}
SURFACE_FIELDS = {"settings": (dict,), "checkpoint": (str,), "round": (int,), "weights_sha256": (str,)}
# the provenance record of every result file (flatfl.analysis.commands.skeleton.AnalysisCommand.header, versions)
PROVENANCE_FIELDS = {"weights_sha256": (str,), "run_settings_sha256": (str,), "round": (int,),
                     "flatfl_version": (str,), "torch_version": (str,)}
for _fields in (HESSIAN_FIELDS, CLIENTS_FIELDS, SURFACE_FIELDS):
    _fields.update({k: v for k, v in PROVENANCE_FIELDS.items() if k not in _fields})
#: the largest magnitude a number that readers compute with may have: more than any value flatfl records, small
#: enough that the report's sums, squares and figure limits stay finite (a runs.csv's numbers have the same bound)
MAX_MAGNITUDE = 1e150
#: the fields holding numbers readers compute with (each number anywhere inside them is range-checked)
NUMBER_FIELDS = ("top_eigenvalues", "residuals", "error_estimates", "trace", "density", "eigenvalue_ratio", "loss",
                 "H_N", "H_D", "H_N_stderr", "H_D_stderr", "clients", "smallest_eigenvalues", "quantities")


def clients_file(protocol: str, kind: str = "json", curvature: str = "hessian") -> str:
    """The name of a protocol's output: 'clients-default.json', or with ``kind='heatmap'`` the heat map's stem
    'clients_heatmap-default' (.png / .pdf); another curvature than the Hessian adds its name
    ('clients-default-ggn.json')."""
    stem = protocol if curvature == "hessian" else f"{protocol}-{curvature}"
    return f"clients-{stem}.json" if kind == "json" else f"clients_heatmap-{stem}"


def read_result_file(path, what: str = "a flatfl result", fields: Mapping[str, tuple] | None = None,
                     hint: str = "remove it or choose another --out") -> dict | None:
    """The JSON object in ``path`` (None when there is no such file), ``fields`` checked; a ResultFileError line
    (``hint`` says what to do) when it is not readable JSON or not ``what``."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested too deeply
        raise ResultFileError(f"{path} is not readable JSON; {hint}") from None
    if not isinstance(data, dict):
        raise ResultFileError(f"{path} is not {what}; {hint}")
    for name, kinds in (fields or {}).items():
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise ResultFileError(f"{path} is not {what} (its {name!r} is {type(value).__name__}); {hint}")
    found = first_out_of_range(data)
    if found is not None:
        name, bad = found
        raise ResultFileError(f"{path} is not {what} (its {name!r} holds {_shown(bad)}: flatfl writes finite numbers "
                              f"within +-{MAX_MAGNITUDE:g}); {hint}")
    return data


def first_out_of_range(data: dict) -> tuple[str, object] | None:
    """``(field, number)``: the first number of ``data``'s :data:`NUMBER_FIELDS` that is not finite or beyond
    :data:`MAX_MAGNITUDE` (what :func:`read_result_file` refuses); None when every one is in range."""
    for name in NUMBER_FIELDS:
        bad = _out_of_range(data.get(name))
        if bad is not None:
            return name, bad
    return None


def _shown(number) -> str:
    """A number as a refusal quotes it: an integer too long to read by its digit count."""
    return f"an integer of {len(str(abs(number)))} digits" if isinstance(number, int) and abs(number) > 1e18 \
        else repr(number)


def _out_of_range(value, depth: int = 0):
    """The first number inside ``value`` (nested lists and dicts) that is not finite or beyond
    :data:`MAX_MAGNITUDE`; None when every one is in range (None entries, strings and booleans are not numbers)."""
    if isinstance(value, bool) or value is None or depth > 8:
        return None
    if isinstance(value, int):  # JSON's integers are exact: compared as integers (float() of 10**400 overflows)
        return None if abs(value) <= MAX_MAGNITUDE else value
    if isinstance(value, numbers.Real):
        return None if math.isfinite(value) and abs(value) <= MAX_MAGNITUDE else value
    parts = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for part in parts:
        bad = _out_of_range(part, depth + 1)
        if bad is not None:
            return bad
    return None


#: hessian.json's lists of numbers, one entry per eigenvalue: at its top level, and in ``smallest_eigenvalues``
EIGENVALUE_LISTS = {"": ("top_eigenvalues", "residuals", "error_estimates"),
                    "smallest_eigenvalues": ("values", "residuals", "error_estimates")}
#: the lists whose entries may be null (an error estimate the method did not give; a residual an estimator gave as
#: not finite, which the file records as null)
NULLABLE = ("residuals", "error_estimates")


def _not_numbers(record: dict, names) -> str | None:
    """The first list ``names`` of ``record`` that holds something else than numbers, as '<field> holds <entry>,
    not a number'; None when every one holds numbers."""
    for name in names:
        entries = record.get(name)
        if entries is None:
            continue
        if not isinstance(entries, list):
            return f"{name} is {type(entries).__name__}, not a list of numbers"
        for v in entries:
            if not ((v is None and name in NULLABLE) or (isinstance(v, numbers.Real) and not isinstance(v, bool))):
                return f"{name} holds {str(v)[:40]!r}, not a number"
    return None


def _bad_quantity(quantities: dict) -> str | None:
    """The first record of hessian.json's ``quantities`` that is not a measured quantity's (an object whose
    ``estimate`` is a number and ``stderr`` a number >= 0 or null), as '<name> ...'; None when each one is."""
    for name, record in quantities.items():
        if not isinstance(record, dict):
            return f"{str(name)[:40]!r} is {type(record).__name__}, not an object"
        for key, optional in (("estimate", False), ("stderr", True)):
            v = record.get(key)
            if not ((v is None and optional) or (isinstance(v, numbers.Real) and not isinstance(v, bool))) or \
                    (key == "stderr" and v is not None and v < 0):
                return f"{str(name)[:40]!r} has the {key} {repr(v)[:40]}"
    return None


def _unrecorded_quantity(data: dict) -> str | None:
    """'frobenius is asked in its settings but not recorded': a quantity the settings' ``measure`` names that
    ``quantities`` lacks; None when each one is there."""
    settings = data.get("settings") or {}
    asked = settings.get("measure")
    if not isinstance(asked, str) or not asked:
        return None
    from ..estimators.quantities import recorded_names

    held = data.get("quantities") or {}
    lacking = [n for n in recorded_names(asked) if n not in held]
    return f"{lacking[0][:40]!r} is asked in its settings but not recorded" if lacking else None


def read_hessian_file(path, hint: str = "remove it or choose another --out") -> dict | None:
    """``hessian.json`` (see :func:`read_result_file`), its per-eigenvalue lists (:data:`EIGENVALUE_LISTS`) holding
    numbers only, each measured quantity's record an estimate and its standard error."""
    data = read_result_file(path, "a flatfl hessian.json", HESSIAN_FIELDS, hint)
    if data is not None:
        for part, names in EIGENVALUE_LISTS.items():
            bad = _not_numbers((data.get(part) or {}) if part else data, names)
            if bad is not None:
                raise ResultFileError(f"{path} is not a flatfl hessian.json (its {part + ': ' if part else ''}{bad});"
                                      f" {hint}")
        bad = _bad_quantity(data.get("quantities") or {}) or _unrecorded_quantity(data)
        if bad is not None:
            raise ResultFileError(f"{path} is not a flatfl hessian.json (its quantities: {bad}); {hint}")
    return data


def read_clients_file(path, hint: str = "remove it or choose another --out") -> dict | None:
    """``clients-<protocol>.json`` (see :func:`read_result_file`)."""
    return read_result_file(path, "a flatfl clients result", CLIENTS_FIELDS, hint)


def read_surface_file(path, hint: str = "remove it or choose another --out") -> dict | None:
    """``surface.json`` (see :func:`read_result_file`)."""
    return read_result_file(path, "a flatfl surface.json", SURFACE_FIELDS, hint)
