-- inter_sim_by_frequency: Inter-Sim within frequency buckets of token types (Zhou et al.'s frequency distortion), sources combined: are rare tokens' vectors more alike than frequent ones'?
-- Formula: bucket of type t = ⌊log₂ n_t⌋ (n_t: its count over all sources); inter_sim = (‖Σ_{t∈bucket} S_t‖² − n)/(n² − n), S_t = Σû of type t (merged over partials), n = Σ_{t∈bucket} n_t. Reads every token vector: cost ∝ types × layers × d
-- Inputs: token_sums
-- Columns: model, checkpoint, step, layer, bucket, types, n, inter_sim
WITH types AS (
    SELECT model, checkpoint, layer, token_id, sum(n) AS n
    FROM token_sums GROUP BY model, checkpoint, layer, token_id
), bucketed AS (
    SELECT model, checkpoint, layer, token_id, n, CAST(floor(log2(n)) AS INTEGER) AS bucket
    FROM types WHERE n >= 1
), elems AS (
    SELECT t.model, t.checkpoint, t.layer, b.bucket, generate_subscripts(t.vec, 1) AS dim,
           unnest(t.vec) AS v
    FROM token_sums t
    JOIN bucketed b ON t.model = b.model AND t.checkpoint = b.checkpoint AND t.layer = b.layer
                   AND t.token_id = b.token_id
), summed AS (
    SELECT model, checkpoint, layer, bucket, dim, sum(CAST(v AS DOUBLE)) AS v
    FROM elems GROUP BY model, checkpoint, layer, bucket, dim
), norms AS (
    SELECT model, checkpoint, layer, bucket, sum(v * v) AS sum_sq
    FROM summed GROUP BY model, checkpoint, layer, bucket
), counts AS (
    SELECT model, checkpoint, layer, bucket, count(*) AS types, CAST(sum(n) AS BIGINT) AS n
    FROM bucketed GROUP BY model, checkpoint, layer, bucket
), steps AS (
    SELECT model, checkpoint, any_value(step) AS step FROM token_sums GROUP BY model, checkpoint
)
SELECT c.model, c.checkpoint, s.step, c.layer, c.bucket, c.types, c.n,
       (o.sum_sq - c.n) / (CAST(c.n AS DOUBLE) * c.n - c.n) AS inter_sim
FROM counts c
JOIN norms o ON c.model = o.model AND c.checkpoint = o.checkpoint AND c.layer = o.layer AND c.bucket = o.bucket
JOIN steps s ON c.model = s.model AND c.checkpoint = s.checkpoint
WHERE c.n >= 2
