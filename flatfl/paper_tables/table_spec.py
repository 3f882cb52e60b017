"""What a reproduced paper table is: its layout (:class:`TableSpec`, what ``flatfl report`` fills and checks) and its
run plan (:class:`PaperTable`: the methods, the settings of each preset, the code each method follows), which
``flatfl reproduce`` trains and analyses."""
from __future__ import annotations

from dataclasses import dataclass, field

@dataclass(frozen=True)
class TableSpec:
    """A table's layout. ``source`` and ``table``: the paper's table it is, as ``paper_values.csv`` names it
    (both None for a layout no paper has); ``metrics``: its columns, names of the report's metric registry
    (:mod:`flatfl.report.metrics`, which says how each is read, labelled and looked up among the papers' values).
    ``rows`` are our method names; ``paper_names`` maps those the paper names differently; ``comparisons`` are
    (reference, compared) row pairs whose direction of change is checked. ``notes``: printed under the table;
    ``curated_notes``: (row, note) pairs of measurements made outside the report, printed among the findings
    (marked as curated) when the row has runs; ``also_tables``: (source, table) pairs of other papers' tables
    whose published values are set beside the rows (and partitions) this layout shares with them."""

    key: str
    source: str | None  # "MAN" / "FedAlign", as in paper_values.csv; None: no paper's table
    table: str | None  # "Table 2", as in paper_values.csv; None: no paper's table
    title: str
    rows: tuple[str, ...]
    partitions: tuple[str, ...]
    metrics: tuple[str, ...]
    comparisons: tuple[tuple[str, str], ...]
    paper_scale: str
    default_model: str = "server"  # the model each row measures unless the report is told otherwise
    paper_names: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    curated_notes: tuple[tuple[str, str], ...] = ()
    also_tables: tuple[tuple[str, str], ...] = ()  # (source, table): values that stand beside the rows they have
    auto_match: bool = True  # made by ``flatfl report`` whenever a run fills it (False: only when named)

    def __post_init__(self) -> None:
        if (self.source is None) != (self.table is None):
            raise ValueError(f"table layout {self.key!r}: give both its paper's source and table, or neither")
        if not all(isinstance(t, tuple) and len(t) == 2 for t in self.also_tables):
            raise ValueError(f"table layout {self.key!r}: also_tables holds (source, table) pairs")

    def paper_name(self, row: str) -> str:
        return dict(self.paper_names).get(row, row)


@dataclass(frozen=True)
class Method:
    """One row of a table: its name, the settings that make it (RunConfig fields and hyper-parameter flags), and
    whether its runs get the top-k spectrum and density (MAN Fig. 4)."""

    label: str
    settings: dict = field(default_factory=dict)
    spectrum: bool = False


@dataclass(frozen=True)
class PaperTable:
    """A table ``flatfl reproduce`` can make: its layout and the runs behind it.

    ``presets``: per preset ('tiny', 'quick', 'paper'), 'run' = RunConfig fields shared by every run; 'hessian' =
    HessianSettings for the table; 'spectrum' = HessianSettings for the Fig. 4 pages; 'clients' =
    ClientMetricsSettings; 'surface' = SurfaceSettings (absent: not computed; each checked by its settings class
    when the runs are planned); 'spectrum_seeds': 'first'
    to measure the spectrum of the first seed only. ``alphas``: the Dirichlet concentrations each method runs at
    (empty: the preset's own ``alpha``). ``code_followed``: per method (or part of one), the code whose behaviour
    every preset follows. ``group``: a target naming this table with the others of its group (``man-tables``).
    ``position``: where the table stands among the others (reports, target lists), lowest first."""

    spec: TableSpec
    methods: tuple[Method, ...]
    presets: dict
    code_followed: dict
    position: int
    alphas: tuple[float, ...] = ()
    group: str | None = None

    def __post_init__(self) -> None:
        # A preset's Hessians are of the training split, asked for by name: an analysis measured on another split
        # (flatfl hessian --split test) then never passes for the preset's (flatfl.run_layout.settings_match compares
        # only the settings asked for) and is computed anew, and the report marks values of another split
        # (flatfl.report.records.RunRecord.setting).
        for preset in self.presets.values():
            for section in ("hessian", "spectrum"):
                if isinstance(preset.get(section), dict):
                    preset[section].setdefault("split", "train")

    @property
    def key(self) -> str:
        return self.spec.key


def with_reg(bases, reg="MAN"):
    """(base, base+reg) comparisons for each base method."""
    return tuple((b, f"{b}+{reg}") for b in bases)
