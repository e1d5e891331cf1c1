-- avg_intra_sim_by_source: average Intra-Sim per layer and text source (shards merged): the unweighted mean over the source's token types with n ≥ 2.
-- Formula: intra_sim(t) = (‖Σû_t‖² − n_t)/(n_t² − n_t) over the n_t vectors of token t in the source; avg = (1/|T|) Σ_{t∈T} intra_sim(t), T = types with n_t ≥ 2 in the source (Σ and |T| summed at commit)
-- Inputs: layer_metrics
-- Columns: model, checkpoint, step, source, layer, tokens, avg_intra_sim
SELECT model, checkpoint, step, source, layer, intra_types AS tokens, intra_sim_sum / intra_types AS avg_intra_sim
FROM layer_metrics
WHERE source <> 'all' AND intra_types > 0
