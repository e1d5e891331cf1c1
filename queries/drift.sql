-- drift: the common drift of a layer's vectors (Biś et al. 2021): the length of the raw mean vector and how well each vector points at it.
-- Formula: μ = Σh/n; mean_norm = ‖μ‖; mean_cos_to_mean = (1/n) Σ_i cos(h_i, μ) = ⟨Σû, Σh⟩ / (n ‖Σh‖), from the merged per-dimension sums
-- Inputs: layer_dims, layer_norms
-- Columns: model, checkpoint, step, source, layer, n, mean_norm, mean_cos_to_mean
WITH totals AS (
    SELECT model, checkpoint, source, layer, sum(h * h) AS hh, sum(u * h) AS uh
    FROM layer_dims GROUP BY model, checkpoint, source, layer
)
SELECT l.model, l.checkpoint, l.step, l.source, l.layer, l.n,
       sqrt(t.hh) / l.n AS mean_norm,
       t.uh / (l.n * sqrt(t.hh)) AS mean_cos_to_mean
FROM layer_norms l
JOIN totals t ON l.model = t.model AND l.checkpoint = t.checkpoint AND l.layer = t.layer AND l.source = t.source
WHERE l.n >= 1 AND t.hh > 0
