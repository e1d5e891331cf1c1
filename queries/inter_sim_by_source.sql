-- inter_sim_by_source: Inter-Sim per layer and text source (shards merged).
-- Formula: inter_sim = (‖Σû‖² − n) / (n² − n) over the token vectors of one source (n ≥ 2)
-- Inputs: layer_norms
-- Columns: model, checkpoint, step, source, layer, n, inter_sim
SELECT model, checkpoint, step, source, layer, n,
       (sum_sq - n) / (CAST(n AS DOUBLE) * n - n) AS inter_sim
FROM layer_norms
WHERE source <> 'all' AND n >= 2
