-- inter_sim_types: frequency-debiased Inter-Sim, every token type weighted equally: the mean cosine between the per-type mean vectors (computed with the derived tables: extract --moments or --sample).
-- Formula: m̂_t = s_t/‖s_t‖ (s_t = Σû over type t); inter_sim_types = (‖Σ_t m̂_t‖² − T)/(T² − T) over the T types seen
-- Inputs: layer_metrics
-- Columns: model, checkpoint, step, source, layer, types, inter_sim_types
SELECT model, checkpoint, step, source, layer, types,
       (types_sum_sq - types) / (CAST(types AS DOUBLE) * types - types) AS inter_sim_types
FROM layer_metrics
WHERE types >= 2
