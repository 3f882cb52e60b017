"""MAN supplementary Table 6: FedASAM and FedSpeed with and without MAN, Dirichlet delta 0.3 and 0.6."""
from __future__ import annotations

from .man_common import ALPHAS, MAN_ACCURACIES, MAN_CODE, MAN_SCALE, PRESETS, pair
from .table_spec import PaperTable, TableSpec, with_reg

SPEC = TableSpec(
    key="man-table6", source="MAN", table="Table 6 (supplementary)",
    title="MAN supplementary Table 6: FedASAM and FedSpeed with and without MAN",
    rows=("FedASAM", "FedASAM+MAN", "FedSpeed", "FedSpeed+MAN"),
    partitions=("dirichlet-0.3", "dirichlet-0.6"), metrics=("top_eigenvalue", "trace", "accuracy"),
    comparisons=with_reg(("FedASAM", "FedSpeed")), paper_scale=MAN_SCALE, default_model="clients-average",
    also_tables=(MAN_ACCURACIES,),
    notes=("the paper's FedASAM and FedASAM+MAN values repeat its Table 2 FedAvg and FedAvg+MAN values digit for "
           "digit (probably a copy error); the FedASAM checks compare with those numbers.",))

TABLE = PaperTable(
    spec=SPEC, position=20, group="man-tables", alphas=ALPHAS, presets=PRESETS,
    methods=(pair("FedASAM", {"algo": "fedasam", "rho": 0.5, "eta": 0.2})
             + pair("FedSpeed", {"algo": "fedspeed", "rho": 0.1, "fedspeed_lambda": 0.01})),
    code_followed={
        "FedASAM": "fedMAN man_code_sam ASAM minimiser (T_w on weights only): flatfl's ASAM, no switch",
        "FedSpeed": "fedMAN train_model_speed (lambda = alpha / w_i): flatfl's fedspeed, except that speedOpt's "
                    "leftover gradient in the ascent (no zero_grad) is not reproduced; it is a bug, not a setting",
        **MAN_CODE},
)
