-- effective_rank: the exponential of the entropy of the normalised covariance spectrum (Roy & Vetterli 2007).
-- Formula: effective_rank = exp(−Σ p_k log p_k), p_k = λ_k/Σλ over the eigenvalues λ_k > 0
-- Inputs: spectrum
-- Columns: model, checkpoint, step, source, layer, n, effective_rank
WITH p AS (
    SELECT model, checkpoint, step, source, layer, n,
           eigenvalue / sum(greatest(eigenvalue, 0)) OVER (PARTITION BY model, checkpoint, source, layer) AS p
    FROM spectrum
)
SELECT model, checkpoint, any_value(step) AS step, source, layer, any_value(n) AS n,
       exp(-sum(CASE WHEN p > 0 THEN p * ln(p) ELSE 0 END)) AS effective_rank
FROM p
GROUP BY model, checkpoint, source, layer
