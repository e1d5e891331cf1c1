-- intra_sentence_sim: Ethayarajh (2019)'s intra-sentence similarity: per window fed to the model (a sentence with --unit sentence), the mean cosine of its token vectors to the window's mean vector, averaged over windows.
-- Formula: intra_sentence_sim = (1/W) Σ_w (1/n_w) Σ_{i∈w} cos(h_i, m_w), m_w = mean of the window's counted vectors; W = windows with n_w ≥ 2 (merged over partials by summing W and the per-window means)
-- Inputs: layer_totals
-- Columns: model, checkpoint, step, source, layer, windows, intra_sentence_sim
SELECT model, checkpoint, step, source, layer, windows, window_cos / windows AS intra_sentence_sim
FROM layer_totals
WHERE windows > 0
