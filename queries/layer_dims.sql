-- layer_dims: helper: per layer and dimension i, the sums Σû, Σh and Σû² merged over shards (per source) and over all sources (source = 'all').
-- Formula: u_i = Σ_p (Σû)_{p,i}, h_i = Σ_p (Σh)_{p,i}, u2_i = Σ_p (Σû²)_{p,i}, p = the (source, shard) partials of a layer (summed at commit into layer_totals)
-- Inputs: layer_totals
-- Columns: model, checkpoint, source, layer, dim, u, h, u2
SELECT model, checkpoint, source, layer, CAST(generate_subscripts(vec, 1) - 1 AS INTEGER) AS dim,
       unnest(vec) AS u, unnest(sum_h) AS h, unnest(sum_u2) AS u2
FROM layer_totals
