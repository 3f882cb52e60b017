"""Client partitions of a training set (docs/update-rules.md section 1).

* ``dirichlet`` - the FedDyn/MAN code's sampler: every client gets exactly n // N samples; client i has a class prior
  p_i ~ Dir(alpha * 1_C); samples are dealt one at a time to a uniformly chosen non-full client, with the class drawn
  from its prior. When a class runs out, the client's prior is renormalised over the classes that still have samples
  (uniform over them if that mass is zero): the code as written can spin forever there (spec pitfall), and the
  renormalisation changes nothing while no class is exhausted.
* ``fedml-dirichlet`` - the FedML/FedAlign/MOON "hetero" split: per class, proportions over clients ~ Dir(alpha);
  clients already holding >= n/N samples get no more; redrawn until the smallest client has >= 10 samples. Client
  sizes are unbalanced.
* ``iid`` - a seeded shuffle split into N nearly equal parts.

Everything is deterministic given ``seed``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, unknown_name

PARTITIONS = ("dirichlet", "fedml-dirichlet", "iid")
FEDML_MIN_CLIENT_SIZE = 10


@dataclass
class Partition:
    method: str
    alpha: float | None
    seed: int
    client_indices: list[np.ndarray]

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    @property
    def sizes(self) -> np.ndarray:
        return np.array([len(ix) for ix in self.client_indices], dtype=np.int64)

    def label_counts(self, labels: np.ndarray, num_classes: int) -> np.ndarray:
        """(N, C) matrix: how many samples of each class each client holds."""
        labels = np.asarray(labels)
        return np.stack([np.bincount(labels[ix], minlength=num_classes) for ix in self.client_indices])

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "alpha": self.alpha,
            "seed": self.seed,
            "client_indices": [ix.tolist() for ix in self.client_indices],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Partition":
        return cls(d["method"], d.get("alpha"), int(d["seed"]),
                   [np.asarray(ix, dtype=np.int64) for ix in d["client_indices"]])


def make_partition(labels, num_clients: int, method: str = "dirichlet", alpha: float | None = 0.3,
                   seed: int = 0) -> Partition:
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    if method not in PARTITIONS:
        raise unknown_name("partition", method, PARTITIONS)
    if num_clients < 1:
        raise ConfigError(f"--clients must be at least 1, got {num_clients}")
    if num_clients > n:
        raise ConfigError(f"more clients ({num_clients}) than training samples ({n})")
    if method != "iid" and (alpha is None or not alpha > 0):
        raise ConfigError(f"the Dirichlet concentration --alpha must be > 0, got {alpha}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= 2**32 - 1:
        raise ConfigError(f"--seed must be an integer in 0..{2**32 - 1}, got {seed!r}")
    rng = np.random.default_rng(seed)
    if method == "iid":
        parts = np.array_split(rng.permutation(n), num_clients)
    elif method == "dirichlet":
        parts = _feddyn_dirichlet(labels, num_clients, float(alpha), rng)
    else:
        if num_clients * FEDML_MIN_CLIENT_SIZE > n:
            raise ConfigError(f"fedml-dirichlet needs at least {FEDML_MIN_CLIENT_SIZE} samples per client: "
                              f"{num_clients} clients x {FEDML_MIN_CLIENT_SIZE} > {n} samples")
        parts = _fedml_dirichlet(labels, num_clients, float(alpha), rng)
    return Partition(method, None if method == "iid" else float(alpha), seed,
                     [np.sort(np.asarray(p, dtype=np.int64)) for p in parts])


def _feddyn_dirichlet(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator) -> list:
    classes = int(labels.max()) + 1
    per_client = len(labels) // num_clients
    priors = rng.dirichlet(alpha * np.ones(classes), size=num_clients)
    # Samples of each class in dataset order; the code deals them from the end of each list.
    by_class = [np.flatnonzero(labels == c) for c in range(classes)]
    remaining = np.array([len(ix) for ix in by_class], dtype=np.int64)
    need = np.full(num_clients, per_client, dtype=np.int64)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    left = int(need.sum())
    while left > 0:
        c_id = int(rng.integers(num_clients))
        if need[c_id] <= 0:
            continue
        need[c_id] -= 1
        left -= 1
        prior = priors[c_id]
        if (remaining[prior > 0] <= 0).any():
            # Renormalise over classes that still have samples (the spec's fix for the infinite redraw loop).
            mass = prior * (remaining > 0)
            prior = mass / mass.sum() if mass.sum() > 0 else (remaining > 0) / (remaining > 0).sum()
        cls = int(np.argmax(rng.uniform() <= np.cumsum(prior)))
        if remaining[cls] <= 0:  # only reachable through float round-off at the top of the cumsum
            cls = int(np.flatnonzero(remaining > 0)[-1])
        remaining[cls] -= 1
        parts[c_id].append(int(by_class[cls][remaining[cls]]))
    return parts


def _fedml_dirichlet(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator,
                     max_tries: int = 1000) -> list:
    classes = int(labels.max()) + 1
    n = len(labels)
    for _ in range(max_tries):
        batches: list[list[int]] = [[] for _ in range(num_clients)]
        for k in range(classes):
            idx_k = np.flatnonzero(labels == k)
            rng.shuffle(idx_k)
            props = rng.dirichlet(np.repeat(alpha, num_clients))
            props = np.array([p * (len(b) < n / num_clients) for p, b in zip(props, batches)])
            props = props / props.sum()
            cuts = (np.cumsum(props) * len(idx_k)).astype(int)[:-1]
            for b, chunk in zip(batches, np.split(idx_k, cuts)):
                b.extend(chunk.tolist())
        if min(len(b) for b in batches) >= FEDML_MIN_CLIENT_SIZE:
            return batches
    raise ConfigError(f"fedml-dirichlet could not give every one of {num_clients} clients "
                      f"{FEDML_MIN_CLIENT_SIZE} samples in {max_tries} draws at alpha={alpha}: use fewer clients or a larger alpha")


def format_histogram(partition: Partition, labels, num_classes: int, max_clients: int | None = None) -> str:
    """A per-client label histogram as a fixed-width text table (one row per client)."""
    counts = partition.label_counts(labels, num_classes)
    rows = counts if max_clients is None else counts[:max_clients]
    w = max(4, len(str(int(counts.max(initial=0)))) + 1)
    head = "client  size " + "".join(f"{c:>{w}}" for c in range(num_classes))
    lines = [head]
    for i, row in enumerate(rows):
        lines.append(f"{i:>6} {int(row.sum()):>5} " + "".join(f"{int(v):>{w}}" for v in row))
    if max_clients is not None and len(counts) > max_clients:
        lines.append(f"... {len(counts) - max_clients} more clients")
    return "\n".join(lines)
