-- avg_intra_sim: average Intra-Sim per layer, the unweighted mean over token types with n ≥ 2.
-- Formula: avg_intra_sim = (1/|T|) Σ_{t ∈ T} intra_sim(t), T = token types with at least two occurrences
-- Inputs: intra_sim
-- Columns: model, checkpoint, step, layer, tokens, avg_intra_sim
SELECT model, checkpoint, any_value(step) AS step, layer,
       count(*) AS tokens, avg(intra_sim) AS avg_intra_sim
FROM intra_sim
GROUP BY model, checkpoint, layer
