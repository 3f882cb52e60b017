"""The SAM family's curvature, side by side: FedSAM, FedASAM, MoFedSAM, FedSpeed and the methods that came after the
source papers (FedSMOO, FedGAMMA, FedLESAM, FedGloSS, FedWMSAM, FedNSAM, FedGMT, FedScar), each with and without
MAN, against FedAvg, Dirichlet delta 0.3 (top Hessian eigenvalue, trace, lambda_1/lambda_5, accuracy; the presets'
Hessian asks for five eigenvalues so that the ratio is there).

No paper publishes this table; the MAN paper's values for the rows it has (FedAvg, FedSAM and FedSAM+MAN in its
Table 2; FedASAM, FedSpeed and their +MAN rows in its supplementary Table 6; CIFAR-100) stand beside ours
(``also_tables``), and give the direction of those rows' comparisons. The others' rules: docs/update-rules.md
§7-§10 and §23-§31.
"""
from __future__ import annotations

from .man_common import MAN_ACCURACIES, MAN_CODE, PRESETS as MAN_PRESETS, pair
from .table_spec import Method, PaperTable, TableSpec, with_reg

BASES = ("FedSAM", "FedASAM", "MoFedSAM", "FedSpeed", "FedSMOO", "FedGAMMA", "FedLESAM", "FedGloSS", "FedWMSAM",
         "FedNSAM", "FedGMT", "FedScar")

SPEC = TableSpec(
    key="sam-family", source=None, table=None,
    title="The SAM family: top Hessian eigenvalue and trace, with and without MAN, against FedAvg",
    rows=("FedAvg",) + tuple(label for base in BASES for label in (base, f"{base}+MAN")),
    partitions=("dirichlet-0.3",), metrics=("top_eigenvalue", "trace", "eigenvalue_ratio", "accuracy"),
    comparisons=with_reg(BASES) + tuple(("FedAvg", base) for base in BASES),
    paper_scale="no paper table: the MAN paper's CIFAR-100 values (Table 2, supplementary Table 6) where it has the "
                "row; the newer methods' papers publish no Hessian values for this protocol",
    default_model="clients-average",
    also_tables=(MAN_ACCURACIES, ("MAN", "Table 2"), ("MAN", "Table 6 (supplementary)")), auto_match=False,  # its rows are other tables' too
    notes=("paper values: MAN Table 2 (FedAvg, FedSAM) and supplementary Table 6 (FedASAM, FedSpeed), CIFAR-100 "
           "at 500 rounds; the MAN paper's FedASAM rows repeat its FedAvg rows digit for digit.",
           "each method at its authors' code's defaults (flatfl algos); FedSAM, FedASAM and FedSpeed at the MAN "
           "tables' settings."))

#: the MAN tables' presets, with the top five eigenvalues of each Hessian (for lambda_1 / lambda_5)
PRESETS = {name: dict(preset, hessian=dict(preset["hessian"], top=5)) for name, preset in MAN_PRESETS.items()}

TABLE = PaperTable(
    spec=SPEC, position=40, presets=PRESETS, alphas=(0.3,),
    methods=((Method("FedAvg", {"algo": "fedavg"}),)
             + pair("FedSAM", {"algo": "fedsam", "rho": 0.05})
             + pair("FedASAM", {"algo": "fedasam", "rho": 0.5, "eta": 0.2})
             + pair("MoFedSAM", {"algo": "mofedsam"})
             + pair("FedSpeed", {"algo": "fedspeed", "rho": 0.1, "fedspeed_lambda": 0.01})
             + pair("FedSMOO", {"algo": "fedsmoo"})
             + pair("FedGAMMA", {"algo": "fedgamma"})
             + pair("FedLESAM", {"algo": "fedlesam"})
             + pair("FedGloSS", {"algo": "fedgloss"})
             + pair("FedWMSAM", {"algo": "fedwmsam"})
             + pair("FedNSAM", {"algo": "fednsam"})
             + pair("FedGMT", {"algo": "fedgmt"})
             + pair("FedScar", {"algo": "fedscar"})),
    code_followed={
        "FedSAM": "fedMAN man_code_sam SAM minimiser: flatfl's SAM (as in MAN Table 2)",
        "FedASAM": "fedMAN man_code_sam ASAM minimiser: flatfl's ASAM (as in MAN Table 6)",
        "MoFedSAM": "the FedSpeed authors' simulator, client/mofedsam.py",
        "FedSpeed": "fedMAN train_model_speed (as in MAN Table 6)",
        "FedSMOO": "the FedSpeed authors' simulator, client/fedsmoo.py and optimizer/DRegSAM.py",
        "FedGAMMA": "the FedSpeed authors' simulator, client/fedgamma.py",
        "FedLESAM": "the FedLESAM authors' code (FedLESAM, the global change of the last round)",
        "FedGloSS": "the FedGloSS authors' code (server-side SAM, ADMM duals); no warm-up of the radii",
        "FedWMSAM": "the FedWMSAM authors' code (client/fedwmsam.py, optimizer/WMSAM.py, server/FedWMSAM.py); each "
                    "entry of the perturbation from its own entry of the direction (no g_update[idx] indexing)",
        "FedNSAM": "the FedNSAM authors' code (main_FedNSAM.py: update_NSAM, apply_weights_avgACG)",
        "FedGMT": "the FedGMT authors' code, harrylee999/FL-SAM (system/flcore/clients/clientgmt.py, "
                  "system/flcore/servers/servergmt.py)",
        "FedScar": "the FedScar authors' code, Ultraman6/FedScar (system/flcore/clients/clientscar.py, "
                   "system/flcore/servers/serverscar.py, system/utils/optim_utils.py: ESAM)",
        **MAN_CODE},
)
