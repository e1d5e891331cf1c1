-- sequence_spectrum: the geometry of sequence-level representations — one pooled vector per window (Skean et al. 2025, "Layer by Layer"), its covariance spectrum's effective rank, anisotropy and αReQ.
-- Formula: z = the window's mean vector (pooling 'mean') or its last vector ('last'), over the W windows with ≥ 1 vector; λ_k = eigenvalues of the covariance of z over windows (W − 1 denominator); effective_rank = exp(−Σ p log p), p = λ/Σλ (λ > 0); anisotropy = λ_max/Σλ; alpha_req as in alpha_req.sql on these λ (ranks up to W − 1)
-- Inputs: sequence_eigenvalues
-- Columns: model, checkpoint, step, source, layer, pooling, windows, effective_rank, anisotropy, alpha_req
WITH s AS (
    SELECT model, checkpoint, step, source, layer, pooling, windows, k, eigenvalue,
           max(k) OVER (PARTITION BY model, checkpoint, source, layer, pooling) AS d,
           max(eigenvalue) OVER (PARTITION BY model, checkpoint, source, layer, pooling) AS top,
           greatest(eigenvalue, 0) / sum(greatest(eigenvalue, 0)) OVER (PARTITION BY model, checkpoint, source, layer, pooling) AS p
    FROM sequence_eigenvalues
    WHERE pooling IN ('mean', 'last')
), fit AS (
    SELECT model, checkpoint, source, layer, pooling, count(*) AS ranks,
           sum(1.0 / k) AS sw, sum(ln(k) / k) AS sx, sum(ln(eigenvalue) / k) AS sy,
           sum(ln(k) * ln(k) / k) AS sxx, sum(ln(k) * ln(eigenvalue) / k) AS sxy
    FROM s
    WHERE k BETWEEN 12 AND least(100, d - 10, windows - 1) AND eigenvalue > 1e-12 * top
    GROUP BY model, checkpoint, source, layer, pooling
), g AS (
    SELECT model, checkpoint, any_value(step) AS step, source, layer, pooling, any_value(windows) AS windows,
           exp(-sum(CASE WHEN p > 0 THEN p * ln(p) ELSE 0 END)) AS effective_rank,
           max(eigenvalue) / sum(eigenvalue) AS anisotropy
    FROM s
    GROUP BY model, checkpoint, source, layer, pooling
)
SELECT g.model, g.checkpoint, g.step, g.source, g.layer, g.pooling, g.windows, g.effective_rank, g.anisotropy,
       CASE WHEN f.ranks >= 10 THEN -(f.sw * f.sxy - f.sx * f.sy) / (f.sw * f.sxx - f.sx * f.sx) END AS alpha_req
FROM g
LEFT JOIN fit f USING (model, checkpoint, source, layer, pooling)
