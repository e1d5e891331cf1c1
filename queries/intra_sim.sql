-- intra_sim: Intra-Sim per layer and token type, sources combined: the mean cosine between distinct occurrences of one token.
-- Formula: intra_sim = (‖Σû_t‖² − n_t) / (n_t² − n_t) over the n_t vectors of token t at the layer (n_t ≥ 2)
-- Inputs: token_norms, vocab
-- Columns: model, checkpoint, step, layer, token_id, token, n, intra_sim
SELECT t.model, t.checkpoint, t.step, t.layer, t.token_id, v.token, t.n,
       (t.sum_sq - t.n) / (CAST(t.n AS DOUBLE) * t.n - t.n) AS intra_sim
FROM token_norms t
LEFT JOIN vocab v ON v.model = t.model AND v.checkpoint = t.checkpoint AND v.token_id = t.token_id
WHERE t.n >= 2
