"""ASD: adaptive self-distillation from the round's global model (Yashwanth et al., TMLR; docs/update-rules.md §17).

Local loss on a batch {(x_i, y_i)} of client k::

    loss = CE + lambda * sum_i alpha_i * KL_i
    KL_i    = sum_c q_g^tau(x_i)_c * (log q_g^tau(x_i)_c - log q_k^tau(x_i)_c)      KL(global || local), no tau^2
    alpha_i = w_i / sum_{j in batch} w_j,   w_i = exp(-beta_H * H_i) / (p_k^{y_i}) ** beta_y
    H_i     = entropy of the untempered global prediction softmax(z_g(x_i))

q^tau = softmax(z / tau); z_g are the logits of the teacher, a frozen copy of the model the server sent this round
(:attr:`RoundContext.global_model`, eval mode), and p_k^y the frequency of label y in client k's whole local
training set (:attr:`ClientContext.label_counts`). Logs come from ``log_softmax`` (the code takes the log of a ratio
of softmaxes), and the weights are normalised in log space (a softmax over log w), which is the same alpha without
overflow.

Defaults (ASD ``config.yml``): tau = 2, beta_H = 1, beta_y = 1. lambda: the shipped ``run_exp.sh`` (CIFAR-100 CNN,
lr 0.1, E = 5) uses 20 and the paper's appendix A.3 sets 20 for all Tiny-ImageNet runs (chosen from {10, 20, 30});
the shipped ``config.yml`` has 2, but it belongs to a ViT setup. Default lambda = 20.

Not copied from the code: FedDyn/FedSpeed's skip of the term on the first minibatch (an undefined index in the FedDyn
path) and the tempered entropy of its FedDyn path (§17, §22). ``--asd-uniform`` replaces alpha by 1/B (the paper's
ablation, ``uniform_distill=1``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..components import REGULARIZERS, HParam
from ..context import Cohort, StepContext
from .regularizer import Regularizer, kl_divergence


def asd_weights(teacher_logits: torch.Tensor, labels: torch.Tensor, label_freq: torch.Tensor, beta_entropy: float,
                beta_label: float) -> torch.Tensor:
    """alpha_i = w_i / sum_j w_j with w_i = exp(-beta_H H_i) * (p^{y_i})^(-beta_y); H_i from the untempered teacher.

    One batch: logits (B, K), labels (B,), label_freq (K,); or one per client: (M, B, K), (M, B), (M, K)."""
    log_q = F.log_softmax(teacher_logits, dim=-1)
    entropy = -(log_q.exp() * log_q).sum(-1)
    if label_freq.dim() == 1:
        freq = label_freq[labels]
    else:
        freq = torch.gather(label_freq, 1, labels)
    log_w = -beta_entropy * entropy - beta_label * torch.log(freq).to(entropy.dtype)
    return torch.softmax(log_w, dim=-1)


def kl_global_local(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-sample KL(softmax(z_g / tau) || softmax(z_k / tau)), shape (..., B), without a tau^2 factor."""
    log_qg = F.log_softmax(teacher_logits / temperature, dim=-1)
    log_qk = F.log_softmax(student_logits / temperature, dim=-1)
    return kl_divergence(log_qg, log_qk)


@REGULARIZERS.register
class ASD(Regularizer):
    name, display_name = "asd", "ASD"
    summary = "ASD: CE + lambda * sum_i alpha_i KL(global || local) at temperature tau, adaptive sample weights"
    hparams = (
        HParam("lam", 20.0, "ASD distillation weight lambda (run_exp.sh and the paper's Tiny-ImageNet value)",
               flag="asd-lambda", check="nonnegative"),
        HParam("beta_label", 1.0, "ASD label-frequency exponent beta_y in w_i = exp(-beta_H H_i) / p^beta_y",
               flag="asd-beta", check="nonnegative"),
        HParam("beta_entropy", 1.0, "ASD entropy exponent beta_H in w_i = exp(-beta_H H_i) / p^beta_y",
               flag="asd-beta-entropy", check="nonnegative"),
        HParam("temperature", 2.0, "distillation temperature tau of ASD's KL (no tau^2 factor)", check="positive"),
        HParam("uniform", False, "ASD ablation: plain mean of KL_i instead of the adaptive weights",
               flag="asd-uniform"),
    )

    def __init__(self, hp: dict[str, Any], *, num_classes: int, config: Any = None):
        super().__init__(hp, num_classes=num_classes, config=config)
        self._teacher = None
        self._label_freq = None

    def start_cohort(self, cohort: Cohort) -> None:
        self._teacher = cohort.round.global_model
        counts = torch.stack([c.label_counts for c in cohort.clients]).to(device=cohort.device, dtype=torch.float64)
        self._label_freq = counts / counts.sum(1, keepdim=True)  # p_k^y over each client's whole training set

    def end_cohort(self, cohort: Cohort) -> None:
        self._teacher = None
        self._label_freq = None

    def penalty(self, step: StepContext) -> torch.Tensor | None:
        if not self.lam:
            return None
        if self._teacher is None:
            raise RuntimeError("ASD.penalty called outside start_cohort/end_cohort")
        m, b = step.y.shape
        with torch.no_grad():
            z_g = self._teacher(step.x.reshape(m * b, *step.x.shape[2:])).view(m, b, -1)
            if self.uniform:
                alpha = torch.full((m, b), 1.0 / b, device=z_g.device, dtype=z_g.dtype)
            else:
                alpha = asd_weights(z_g, step.y, step.select(self._label_freq), self.beta_entropy, self.beta_label)
        kl = kl_global_local(z_g, step.logits, self.temperature)
        return self.lam * (alpha * kl).sum(-1)
