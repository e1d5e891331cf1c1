-- token_norms: per (layer, token type), the count n and ‖Σû‖² merged over every source and shard.
-- Formula: ‖Σ_p s_p‖² = Σ_p sum_sq_p + 2 Σ_{p<q} ⟨s_p, s_q⟩, p, q = the (source, shard) partials of a token; n = Σ_p n_p
-- Inputs: token_sums
-- Columns: model, checkpoint, step, layer, token_id, n, sum_sq
WITH cross_sums AS (
    SELECT p.model, p.checkpoint, p.layer, p.token_id,
           sum(2 * list_inner_product(CAST(p.vec AS DOUBLE[]), CAST(q.vec AS DOUBLE[]))) AS c
    FROM token_sums p
    JOIN token_sums q
      ON p.model = q.model AND p.checkpoint = q.checkpoint AND p.layer = q.layer
     AND p.token_id = q.token_id
     AND (p.source < q.source OR (p.source = q.source AND p.shard < q.shard))
    GROUP BY p.model, p.checkpoint, p.layer, p.token_id
), diagonal AS (
    SELECT model, checkpoint, any_value(step) AS step, layer, token_id,
           CAST(sum(n) AS BIGINT) AS n, sum(sum_sq) AS sum_sq
    FROM token_sums
    GROUP BY model, checkpoint, layer, token_id
)
SELECT d.model, d.checkpoint, d.step, d.layer, d.token_id, d.n, d.sum_sq + coalesce(c.c, 0) AS sum_sq
FROM diagonal d
LEFT JOIN cross_sums c
  ON d.model = c.model AND d.checkpoint = c.checkpoint AND d.layer = c.layer AND d.token_id = c.token_id
