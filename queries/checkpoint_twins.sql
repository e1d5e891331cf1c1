-- checkpoint_twins: checkpoints of one model whose weights equal another checkpoint's (every tensor's name, dtype, shape and bytes), e.g. hub branches that serve the final weights.
-- Formula: per model, checkpoints grouped by the tensor fingerprint of their weights (provenance.model_identity `tensors …`); each group's checkpoint with the largest step (then the first by name; checkpoints without a step after every stepped one) is the one the others are twins of: one row per other checkpoint, twin_of naming it
-- Inputs: runs
-- Columns: model, checkpoint, step, twin_of, twin_step, weights
WITH w AS (
    SELECT DISTINCT model, checkpoint, step, json_extract_string(provenance, '$.model_identity') AS weights
    FROM runs
    WHERE kind IN ('data', 'params')
      AND starts_with(coalesce(json_extract_string(provenance, '$.model_identity'), ''), 'tensors ')
), ranked AS (
    SELECT *,
           first_value(checkpoint) OVER g AS twin_of,
           first_value(step) OVER g AS twin_step
    FROM w
    WINDOW g AS (PARTITION BY model, weights ORDER BY step IS NULL, step DESC, checkpoint
                 ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)
)
SELECT model, checkpoint, step, twin_of, twin_step, weights
FROM ranked
WHERE checkpoint <> twin_of
ORDER BY model, step, checkpoint
