-- avg_intra_sim: average Intra-Sim per layer, the unweighted mean over token types with n ≥ 2.
-- Formula: avg_intra_sim = (1/|T|) Σ_{t ∈ T} intra_sim(t), intra_sim(t) = (‖Σû_t‖² − n_t)/(n_t² − n_t), T = token types with at least two occurrences (Σ and |T| summed at commit over the merged types, source = 'all')
-- Inputs: layer_metrics
-- Columns: model, checkpoint, step, layer, tokens, avg_intra_sim
SELECT model, checkpoint, step, layer, intra_types AS tokens, intra_sim_sum / intra_types AS avg_intra_sim
FROM layer_metrics
WHERE source = 'all' AND intra_types > 0
