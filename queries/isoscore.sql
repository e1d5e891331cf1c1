-- isoscore: IsoScore (Rudman et al.; package isoscore, IsoScore) of a layer's hidden states from the covariance spectrum.
-- Formula: λ̂ = λ·√d/‖λ‖; δ = ‖λ̂ − 1‖/√(2(d − √d)); isoscore = ((d − δ²(d − √d))² − d)/(d(d − 1)); IsoScore* with C₀ = I: warehouse.metrics.isoscore_star(ζ)
-- Inputs: spectrum
-- Columns: model, checkpoint, step, source, layer, n, isoscore
WITH s AS (
    SELECT model, checkpoint, step, source, layer, n, eigenvalue,
           count(*) OVER w AS d, sqrt(sum(eigenvalue * eigenvalue) OVER w) AS norm
    FROM spectrum
    WINDOW w AS (PARTITION BY model, checkpoint, source, layer)
), delta AS (
    SELECT model, checkpoint, any_value(step) AS step, source, layer, any_value(n) AS n, any_value(d) AS d,
           sqrt(sum(power(eigenvalue * sqrt(d) / norm - 1, 2))) / sqrt(2 * (any_value(d) - sqrt(any_value(d)))) AS delta
    FROM s
    GROUP BY model, checkpoint, source, layer
)
SELECT model, checkpoint, step, source, layer, n,
       (power(d - delta * delta * (d - sqrt(d)), 2) - d) / (d * (d - 1.0)) AS isoscore
FROM delta
