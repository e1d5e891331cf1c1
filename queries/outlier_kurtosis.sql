-- outlier_kurtosis: the kurtosis of the per-dimension second moments, high where a few dimensions carry outlier features (He et al. 2024, "Understanding and Minimising Outlier Features").
-- Formula: s_j = Σ h_j² / n, the raw second moment of dimension j over the layer's n counted vectors (= mean_j² + variance_j·(n − 1)/n); kurtosis = mean_j s_j² / (mean_j s_j)²
-- Inputs: dim_variance, spectrum
-- Columns: model, checkpoint, step, source, layer, n, kurtosis
WITH n AS (
    SELECT model, checkpoint, source, layer, any_value(n) AS n
    FROM spectrum
    GROUP BY model, checkpoint, source, layer
), s AS (
    SELECT v.model, v.checkpoint, v.step, v.source, v.layer, n.n,
           v.mean * v.mean + v.variance * (n.n - 1) / n.n AS s
    FROM dim_variance v
    JOIN n USING (model, checkpoint, source, layer)
)
SELECT model, checkpoint, any_value(step) AS step, source, layer, any_value(n) AS n,
       avg(s * s) / (avg(s) * avg(s)) AS kurtosis
FROM s
GROUP BY model, checkpoint, source, layer
