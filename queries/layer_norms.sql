-- layer_norms: per layer, the count n and ‖Σû‖² merged over shards (per source) and over all sources (source = 'all').
-- Formula: ‖Σ_p s_p‖² = Σ_p sum_sq_p + 2 Σ_{p<q} ⟨s_p, s_q⟩, p, q = the (source, shard) partials of a layer; n = Σ_p n_p
-- Inputs: layer_sums
-- Columns: model, checkpoint, step, source, layer, layer_kind, n_layers, n, sum_sq, n_nonfinite, n_zero
WITH cross_terms AS (
    SELECT p.model, p.checkpoint, p.layer, p.source AS source_p, q.source AS source_q,
           2 * list_inner_product(p.vec, q.vec) AS c
    FROM layer_sums p
    JOIN layer_sums q
      ON p.model = q.model AND p.checkpoint = q.checkpoint AND p.layer = q.layer
     AND (p.source < q.source OR (p.source = q.source AND p.shard < q.shard))
), cross_sums AS (
    SELECT model, checkpoint, layer, source_p AS source, sum(c) AS c
    FROM cross_terms WHERE source_p = source_q GROUP BY model, checkpoint, layer, source_p
    UNION ALL
    SELECT model, checkpoint, layer, 'all' AS source, sum(c) AS c
    FROM cross_terms GROUP BY model, checkpoint, layer
), diagonal AS (
    SELECT model, checkpoint, any_value(step) AS step, coalesce(source, 'all') AS source, layer,
           any_value(layer_kind) AS layer_kind, any_value(n_layers) AS n_layers,
           CAST(sum(n) AS BIGINT) AS n, sum(sum_sq) AS sum_sq,
           CAST(sum(n_nonfinite) AS BIGINT) AS n_nonfinite, CAST(sum(n_zero) AS BIGINT) AS n_zero
    FROM layer_sums
    GROUP BY GROUPING SETS ((model, checkpoint, layer, source), (model, checkpoint, layer))
)
SELECT d.model, d.checkpoint, d.step, d.source, d.layer, d.layer_kind, d.n_layers, d.n,
       d.sum_sq + coalesce(c.c, 0) AS sum_sq, d.n_nonfinite, d.n_zero
FROM diagonal d
LEFT JOIN cross_sums c
  ON d.model = c.model AND d.checkpoint = c.checkpoint AND d.layer = c.layer AND d.source = c.source
