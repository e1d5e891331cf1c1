-- layer_change: how much each layer changes the residual stream (block influence: ShortGPT, Men et al. 2024; angular distance: Gromov et al. 2024): row l compares hidden states l and l + 1 (0 = embedding output, i = output of block i, then the final norm) of the same tokens.
-- Formula: over the n tokens counted (finite, non-zero) at both layers, block_influence = 1 − (1/n) Σ cos(h_l, h_{l+1}); angular_distance = (1/n) Σ θ/π, θ = arccos(cos) taken as 2·atan2(‖û_l − û_{l+1}‖, ‖û_l + û_{l+1}‖) in float64 (no loss of precision near cos = ±1); sums merged over partials
-- Inputs: layer_totals
-- Columns: model, checkpoint, step, source, layer, n, block_influence, angular_distance
SELECT model, checkpoint, step, source, layer, change_n AS n,
       1 - change_cos / change_n AS block_influence,
       change_angle / change_n AS angular_distance
FROM layer_totals
WHERE change_n > 0
