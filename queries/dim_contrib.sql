-- dim_contrib: each dimension's contribution to Inter-Sim (Timkey & van Schijndel 2021, "All bark and no bite"); the contributions of a layer sum to its inter_sim.
-- Formula: contrib_i = ((Σû)_i² − Σ û_i²) / (n² − n), Σû and Σû² (per dimension) summed over every counted vector of the layer (partials merged by summing)
-- Inputs: layer_sums, layer_norms
-- Columns: model, checkpoint, step, source, layer, dim, contrib
WITH elems AS (
    SELECT model, checkpoint, source, layer, generate_subscripts(vec, 1) - 1 AS dim,
           unnest(vec) AS u, unnest(sum_u2) AS u2
    FROM layer_sums
), merged AS (
    SELECT model, checkpoint, coalesce(source, 'all') AS source, layer, dim, sum(u) AS u, sum(u2) AS u2
    FROM elems
    GROUP BY GROUPING SETS ((model, checkpoint, layer, dim, source), (model, checkpoint, layer, dim))
)
SELECT l.model, l.checkpoint, l.step, l.source, l.layer, CAST(m.dim AS INTEGER) AS dim,
       (m.u * m.u - m.u2) / (CAST(l.n AS DOUBLE) * l.n - l.n) AS contrib
FROM merged m
JOIN layer_norms l ON l.model = m.model AND l.checkpoint = m.checkpoint AND l.layer = m.layer AND l.source = m.source
WHERE l.n >= 2
