-- token_norms: per (layer, token type), the count n and ‖Σû‖² merged over every source and shard.
-- Formula: ‖Σ_p s_p‖² = Σ_p sum_sq_p + 2 Σ_{p<q} ⟨s_p, s_q⟩, p, q = the (source, shard) partials of a token; n = Σ_p n_p — folded once per partial at commit (warehouse/merge/fold_tokens.py), read here from token_stats
-- Inputs: token_stats
-- Columns: model, checkpoint, step, layer, token_id, n, sum_sq
SELECT model, checkpoint, step, layer, token_id, n, sum_sq
FROM token_stats
WHERE source = 'all'
