"""FedDisco: discrepancy-aware aggregation (Ye et al. ICML 2023), as in the official code (``disco.py``,
``algorithms/fedavg.py``; docs/update-rules.md section 15).

Local training is FedAvg's. Each round, over the participating clients P_t with sizes n_k and label
distributions q_k (the client's label counts over its training set, normalised)::

    d_k = KL(q_k || uniform),  normalised so that sum_{P_t} d_k = 1 (all 0 if every d_k is 0)
    p_k = ReLU(n_k / sum_{P_t} n - a d_k + b),  renormalised to sum 1
    theta^{t+1} = sum_{P_t} p_k theta_k

If every ReLU term is 0 (possible only with a > 1), the weights fall back to n_k / sum n.

Defaults: a = 0.5, b = 0.1 (official code). ASD's port swaps them (a = 0.1, b = 0.5), computes the weights once
over all N clients and has empty class counts in its released main.py; not reproduced.
"""
from __future__ import annotations

import numpy as np

from ..components import HParam
from .algorithm import Algorithm, ClientResult, register, weighted_mean


def disco_weights(sizes, label_counts, a: float, b: float) -> np.ndarray:
    """FedDisco's aggregation weights p_k for clients with ``sizes`` (K,) and ``label_counts`` (K, C)."""
    sizes = np.asarray(sizes, dtype=np.float64)
    counts = np.asarray(label_counts, dtype=np.float64)
    q = counts / counts.sum(1, keepdims=True)
    num_classes = counts.shape[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(q > 0, q * np.log(q * num_classes), 0.0).sum(1)
    d = kl / kl.sum() if kl.sum() > 0 else np.zeros_like(kl)
    p = np.maximum(sizes / sizes.sum() - a * d + b, 0.0)
    return p / p.sum() if p.sum() > 0 else sizes / sizes.sum()


@register
class FedDisco(Algorithm):
    name, display_name = "feddisco", "FedDisco"
    summary = "FedDisco: FedAvg aggregation reweighted by each client's label-distribution discrepancy"
    hparams = (HParam("a", 0.5, "FedDisco discrepancy weight a (official code; ASD's port uses 0.1)", flag="disco-a",
                      check="nonnegative"),
               HParam("b", 0.1, "FedDisco offset b (official code; ASD's port uses 0.5)", flag="disco-b"))

    def client_end(self, cctx, params, loss):
        return ClientResult(cctx.client_id, cctx.num_samples, params, loss,
                            extras={"label_counts": cctx.label_counts.detach().cpu().numpy()})

    def aggregate(self, rctx, results):
        p = disco_weights([r.num_samples for r in results], np.stack([r.extras["label_counts"] for r in results]),
                          self.a, self.b)
        return weighted_mean([r.params for r in results], p)
