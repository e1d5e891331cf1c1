-- drift: the common drift of a layer's vectors (Biś et al. 2021): the length of the raw mean vector and how well each vector points at it.
-- Formula: μ = Σh/n; mean_norm = ‖μ‖; mean_cos_to_mean = (1/n) Σ_i cos(h_i, μ) = ⟨Σû, Σh⟩ / (n ‖Σh‖); sums merged over partials as Σ_p Σ_q ⟨a_p, b_q⟩
-- Inputs: layer_sums, layer_norms
-- Columns: model, checkpoint, step, source, layer, n, mean_norm, mean_cos_to_mean
WITH pairs AS (
    SELECT p.model, p.checkpoint, p.layer, p.source AS source_p, q.source AS source_q,
           list_inner_product(p.sum_h, q.sum_h) AS hh, list_inner_product(p.vec, q.sum_h) AS uh
    FROM layer_sums p
    JOIN layer_sums q ON p.model = q.model AND p.checkpoint = q.checkpoint AND p.layer = q.layer
), merged AS (
    SELECT model, checkpoint, layer, source_p AS source, sum(hh) AS hh, sum(uh) AS uh
    FROM pairs WHERE source_p = source_q GROUP BY model, checkpoint, layer, source_p
    UNION ALL
    SELECT model, checkpoint, layer, 'all' AS source, sum(hh) AS hh, sum(uh) AS uh
    FROM pairs GROUP BY model, checkpoint, layer
)
SELECT l.model, l.checkpoint, l.step, l.source, l.layer, l.n,
       sqrt(m.hh) / l.n AS mean_norm,
       m.uh / (l.n * sqrt(m.hh)) AS mean_cos_to_mean
FROM layer_norms l
JOIN merged m ON l.model = m.model AND l.checkpoint = m.checkpoint AND l.layer = m.layer AND l.source = m.source
WHERE l.n >= 1 AND m.hh > 0
