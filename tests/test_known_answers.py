"""Known answers, without a model: αReQ of an exact power law and where it is NULL, the anisotropy,
effective rank and IsoScore views over isotropic, rank-k and Gaussian spectra (IsoScore's package
beside them), and the linearity of an exactly affine layer pair."""

from __future__ import annotations

import numpy as np
import pytest

import reference as ref
from warehouse.measures import covariance, cross_covariance, linearity_from_cov
from warehouse.query import load_metrics


def test_alpha_req_known_answers_and_null():
    """λ_k = 3·k^(−1.3) exactly: α = 1.3; ranks beyond the fit window and λ ≤ 0 outside it are
    ignored; fewer than 10 ranks in range (d = 30: k = 12 … 20) or λ ≤ 0 inside it: NULL."""
    import duckdb

    def fit(eigs):
        con = duckdb.connect()
        con.execute("CREATE TABLE spectrum (model VARCHAR, checkpoint VARCHAR, step BIGINT, source VARCHAR, "
                    "layer SMALLINT, n BIGINT, k INTEGER, eigenvalue DOUBLE)")
        con.executemany("INSERT INTO spectrum VALUES ('m', 'c', NULL, 'all', 0, 1000, ?, ?)",
                        [[k, float(v)] for k, v in enumerate(eigs, 1)])
        body = next(m.body for m in load_metrics() if m.name == "alpha_req")
        return con.execute(f"SELECT alpha_req FROM ({body})").fetchall()[0][0]

    k = np.arange(1, 257, dtype=float)
    lam = 3 * k ** -1.3
    assert fit(lam) == pytest.approx(1.3, rel=1e-12)
    noisy = lam * np.exp(np.random.default_rng(0).normal(0, 0.1, len(k)))
    assert fit(np.sort(noisy)[::-1]) == pytest.approx(ref.alpha_req_numpy(np.sort(noisy)[::-1]), rel=1e-9)
    assert fit(np.r_[lam[:-1], 0.0]) == pytest.approx(1.3, rel=1e-12)  # k = 256 is outside the window
    assert fit(lam[:30]) is None and ref.alpha_req_numpy(lam[:30]) is None  # 9 ranks
    assert fit(lam[:31]) == pytest.approx(1.3, rel=1e-12)  # 10 ranks
    assert fit(np.r_[lam[:12], np.zeros(19)]) is None  # rank-deficient: no λ > 0 in the window
    assert fit(np.r_[lam[:20], 1e-17 * lam[20:60]]) is None  # rank 20, then float64 noise: ranks 12 … 20 only
    assert fit(np.r_[lam[:40], 1e-17 * lam[40:60]]) == pytest.approx(1.3, rel=1e-12)  # ranks 12 … 40


def views_over(spectrum_rows):
    """The SQL views anisotropy, effective_rank and isoscore over a synthetic spectrum table."""
    import duckdb

    con = duckdb.connect()
    con.execute("CREATE TABLE spectrum (model VARCHAR, checkpoint VARCHAR, step BIGINT, source VARCHAR, "
                "layer SMALLINT, n BIGINT, k INTEGER, eigenvalue DOUBLE)")
    con.executemany("INSERT INTO spectrum VALUES ('m', 'c', NULL, 'all', 0, 1000, ?, ?)",
                    [[k, v] for k, v in enumerate(spectrum_rows, 1)])
    for m in load_metrics():
        if m.name in ("anisotropy", "effective_rank", "isoscore"):
            con.execute(f"CREATE VIEW {m.name} AS {m.body}")
    return {v: con.execute(f"SELECT {v} FROM {v}").fetchall()[0][0] for v in ("anisotropy", "effective_rank", "isoscore")}


def test_known_answers_isotropic_and_rank_k():
    d = 16
    iso = views_over([2.0] * d)
    assert iso["anisotropy"] == pytest.approx(1 / d) and iso["effective_rank"] == pytest.approx(d)
    assert iso["isoscore"] == pytest.approx(1.0)
    k = 4
    low = views_over([3.0] * k + [0.0] * (d - k))
    assert low["anisotropy"] == pytest.approx(1 / k) and low["effective_rank"] == pytest.approx(k)
    from IsoScore import IsoScore

    rng = np.random.default_rng(0)
    X = rng.normal(size=(5000, k)) @ np.linalg.qr(rng.normal(size=(d, d)))[0][:k]  # a rank-4 subspace of R^16
    spectrum = np.sort(np.linalg.eigvalsh(np.cov(X.T)))[::-1]
    # (IsoScore takes sqrt(d) of an int64 tensor, i.e. in float32: agreement to ~1e-7)
    assert views_over(list(spectrum))["isoscore"] == pytest.approx(float(IsoScore.IsoScore(X)), rel=1e-6)
    assert float(IsoScore.IsoScore(X)) < 0.25  # 4 of 16 dimensions used
    # an isotropic Gaussian sample: close to isotropic by every measure
    G = rng.normal(size=(20000, d))
    g = views_over(list(np.sort(np.linalg.eigvalsh(np.cov(G.T)))[::-1]))
    assert g["isoscore"] > 0.99 and g["anisotropy"] < 1.2 / d and g["effective_rank"] > 0.99 * d


def test_known_answer_exactly_linear_layer_pair():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(500, 8)) + 3.0
    Y = X @ rng.normal(size=(8, 8)) + 1.5  # affine: linear after centring
    n = len(X)
    cxx, cyy = covariance(n, X.sum(0), X.T @ X), covariance(n, Y.sum(0), Y.T @ Y)
    cxy = cross_covariance(n, X.sum(0), Y.sum(0), X.T @ Y)
    assert linearity_from_cov(cxx, cyy, cxy) == pytest.approx(1.0, abs=1e-10)
    Z = rng.normal(size=(500, 8))  # unrelated: ~ d/n
    czz, cxz = covariance(n, Z.sum(0), Z.T @ Z), cross_covariance(n, X.sum(0), Z.sum(0), X.T @ Z)
    assert linearity_from_cov(cxx, czz, cxz) < 0.05
