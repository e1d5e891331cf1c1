-- random_word_sim: Ethayarajh (2019)'s baseline of "randomly sampled words": the mean cosine between a token vector of one window and a token vector of another, each window weighing one (inter_sim weighs tokens); with --unit sentence a window is a sentence, as in the paper.
-- Formula: ū_w = (1/n_w) Σ_{i∈w} û_i per window with n_w ≥ 1 counted vectors (ū = û for one), W such windows; random_word_sim = (‖Σ_w ū_w‖² − Σ_w ‖ū_w‖²) / (W² − W) = the mean over window pairs w ≠ w' of the mean cos(h_i, h_j), i ∈ w, j ∈ w'; sums merged over partials
-- Inputs: layer_totals
-- Columns: model, checkpoint, step, source, layer, windows, random_word_sim
SELECT model, checkpoint, step, source, layer, unit_windows AS windows,
       (list_dot_product(sum_ubar, sum_ubar) - sum_ubar_sq) / (CAST(unit_windows AS DOUBLE) * unit_windows - unit_windows)
           AS random_word_sim
FROM layer_totals
WHERE unit_windows >= 2
