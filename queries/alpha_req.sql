-- alpha_req: αReQ, the power-law decay exponent of the covariance spectrum (Agrawal et al. 2022; Li et al. 2025 across Pythia/OLMo checkpoints), with Stringer et al.'s weighted fit.
-- Formula: α = −slope of the weighted least-squares fit log λ_k = b − α·log k, weights 1/k, over ranks k = 12 … min(100, d − 10, n − 1) with λ_k > 10⁻¹² λ_1 (λ_k the covariance eigenvalues, descending; d the layer's width; a rank-deficient covariance — beyond rank n − 1, or fewer distinct vectors — has zero eigenvalues, which float64 turns into noise below ~10⁻¹⁴ λ_1); NULL when fewer than 10 ranks are in range
-- Inputs: spectrum
-- Columns: model, checkpoint, step, source, layer, n, alpha_req
WITH s AS (
    SELECT model, checkpoint, step, source, layer, n, k, eigenvalue,
           max(k) OVER w AS d, max(eigenvalue) OVER w AS top
    FROM spectrum
    WINDOW w AS (PARTITION BY model, checkpoint, source, layer)
), fit AS (
    SELECT model, checkpoint, source, layer, count(*) AS ranks,
           sum(1.0 / k) AS sw, sum(ln(k) / k) AS sx, sum(ln(eigenvalue) / k) AS sy,
           sum(ln(k) * ln(k) / k) AS sxx, sum(ln(k) * ln(eigenvalue) / k) AS sxy
    FROM s
    WHERE k BETWEEN 12 AND least(100, d - 10, n - 1) AND eigenvalue > 1e-12 * top
    GROUP BY model, checkpoint, source, layer
), layers AS (
    SELECT model, checkpoint, any_value(step) AS step, source, layer, any_value(n) AS n
    FROM spectrum
    GROUP BY model, checkpoint, source, layer
)
SELECT l.model, l.checkpoint, l.step, l.source, l.layer, l.n,
       CASE WHEN f.ranks >= 10 THEN -(f.sw * f.sxy - f.sx * f.sy) / (f.sw * f.sxx - f.sx * f.sx) END AS alpha_req
FROM layers l
LEFT JOIN fit f USING (model, checkpoint, source, layer)
