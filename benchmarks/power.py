"""Power of exploration parity at the default threshold, simulated with the package's own tests.

    python -m benchmarks.power

For a category probability moved from 0.5 by ``d`` (chi-square homogeneity) and a Gaussian mean
moved by ``d`` standard deviations (two-sample Kolmogorov-Smirnov), prints the share of 200
simulated checks that fail, with 2,500 draws per side (10,000 draws over 4 observations) and the
Bonferroni threshold of a 4-test family at the default alpha.
"""

from __future__ import annotations

import numpy as np

from policy_export.exporter.defaults import DEFAULT_ALPHA, DEFAULT_EXPLORE_SAMPLES, DEFAULT_OBSERVATIONS
from policy_export.exporter.parity.exploration import chi_square_homogeneity, ks_two_sample

TRIALS = 200


def main() -> None:
    rng = np.random.default_rng(0)
    n = DEFAULT_EXPLORE_SAMPLES // DEFAULT_OBSERVATIONS
    threshold = DEFAULT_ALPHA / DEFAULT_OBSERVATIONS
    print(f"{n} draws per side, threshold p < {threshold:.3g}, {TRIALS} trials each")
    for d in (0.0, 0.05, 0.08, 0.10, 0.12):
        hits = sum(chi_square_homogeneity((rng.random(n) < 0.5).astype(int),
                                          (rng.random(n) < 0.5 + d).astype(int))[1] < threshold
                   for _ in range(TRIALS))
        print(f"category probability 0.5 -> {0.5 + d:.2f}: detected in {hits / TRIALS:.1%}")
    for d in (0.0, 0.1, 0.2, 0.25, 0.3):
        hits = sum(ks_two_sample(rng.normal(size=n), rng.normal(d, size=n))[1] < threshold for _ in range(TRIALS))
        print(f"Gaussian mean moved by {d:.2f} std: detected in {hits / TRIALS:.1%}")


if __name__ == "__main__":
    main()
