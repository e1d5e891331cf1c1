-- massive_activations: the largest activations of a layer and where they occur (Sun et al. 2024, "Massive Activations in Large Language Models"): a few dimensions at a few tokens, thousands of times the typical magnitude.
-- Formula: the top 10 |h_j| over every counted vector and dimension j of the layer (rank 1 = largest; ties by source, document, position, dim); ratio_to_mean_abs = |h_j| / (Σ|h| / (n·d)), the mean |h| over the n counted vectors × d dimensions; token from the vocabulary; document_source, document, position: where it occurs (document: the index in its source)
-- Inputs: massive_merged, layer_totals, vocab
-- Columns: model, checkpoint, step, source, layer, rank, dim, abs_value, token_id, token, document_source, document, position, ratio_to_mean_abs
SELECT m.model, m.checkpoint, m.step, m.source, m.layer, m.rank, m.dim, m.abs_value, m.token_id, v.token,
       m.document_source, m.document, m.position,
       m.abs_value / (t.sum_abs / (t.n * len(t.sum_h))) AS ratio_to_mean_abs
FROM massive_merged m
JOIN layer_totals t USING (model, checkpoint, source, layer)
LEFT JOIN vocab v ON v.model = m.model AND v.checkpoint = m.checkpoint AND v.token_id = m.token_id
