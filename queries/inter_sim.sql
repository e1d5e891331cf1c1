-- inter_sim: Inter-Sim per layer (Machina & Mercer 2024, Eq. 7), all sources combined: the mean cosine between distinct token vectors.
-- Formula: inter_sim = (‖Σû‖² − n) / (n² − n), û = h/‖h‖ over every counted token vector of the layer (n ≥ 2)
-- Inputs: layer_norms
-- Columns: model, checkpoint, step, layer, n, inter_sim
SELECT model, checkpoint, step, layer, n,
       (sum_sq - n) / (CAST(n AS DOUBLE) * n - n) AS inter_sim
FROM layer_norms
WHERE source = 'all' AND n >= 2
