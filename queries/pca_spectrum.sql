-- pca_spectrum: the covariance eigenvalues of a layer's hidden states, largest first (needs extract --moments).
-- Formula: eigenvalues λ_k of C = (Σhhᵀ − (Σh)(Σh)ᵀ/n)/(n − 1); share = λ_k/Σλ; cumulative_share = Σ_{j≤k} λ_j/Σλ
-- Inputs: spectrum
-- Columns: model, checkpoint, step, source, layer, n, k, eigenvalue, share, cumulative_share
SELECT model, checkpoint, step, source, layer, n, k, eigenvalue,
       eigenvalue / sum(eigenvalue) OVER w AS share,
       sum(eigenvalue) OVER (w ORDER BY k ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) / sum(eigenvalue) OVER w AS cumulative_share
FROM spectrum
WINDOW w AS (PARTITION BY model, checkpoint, source, layer)
