"""FedAvg (McMahan et al. 2017; docs/update-rules.md section 2).

Client: E epochs of local SGD on the cross-entropy. Server: theta^{t+1} = sum_{i in P_t} n_i theta_i / sum n_i.
No state beyond theta. (With ``--local-opt sam`` this is FedSAM, with ``asam`` FedASAM.)
"""
from .algorithm import Algorithm, register


@register
class FedAvg(Algorithm):
    name, display_name = "fedavg", "FedAvg"
    summary = "FedAvg: local SGD, sample-weighted average of the participants' models"
