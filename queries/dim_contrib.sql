-- dim_contrib: each dimension's contribution to Inter-Sim (Timkey & van Schijndel 2021, "All bark and no bite"); the contributions of a layer sum to its inter_sim.
-- Formula: contrib_i = ((Σû)_i² − Σ û_i²) / (n² − n), Σû and Σû² (per dimension) summed over every counted vector of the layer (partials merged by summing)
-- Inputs: layer_dims, layer_norms
-- Columns: model, checkpoint, step, source, layer, dim, contrib
SELECT l.model, l.checkpoint, l.step, l.source, l.layer, m.dim,
       (m.u * m.u - m.u2) / (CAST(l.n AS DOUBLE) * l.n - l.n) AS contrib
FROM layer_dims m
JOIN layer_norms l ON l.model = m.model AND l.checkpoint = m.checkpoint AND l.layer = m.layer AND l.source = m.source
WHERE l.n >= 2
