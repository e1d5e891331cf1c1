-- layer_norms: per layer, the count n and ‖Σû‖² merged over shards (per source) and over all sources (source = 'all').
-- Formula: ‖Σ_p s_p‖² = Σ_p sum_sq_p + 2 Σ_{p<q} ⟨s_p, s_q⟩, p, q = the (source, shard) partials of a layer; n = Σ_p n_p — folded at commit into layer_totals
-- Inputs: layer_totals
-- Columns: model, checkpoint, step, source, layer, layer_kind, n_layers, n, sum_sq, n_nonfinite, n_zero
SELECT model, checkpoint, step, source, layer, layer_kind, n_layers, n, sum_sq, n_nonfinite, n_zero
FROM layer_totals
