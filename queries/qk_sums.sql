-- qk_sums: per attention head, the query and key sums joined (each query head with the key head it reads, h // (H / H_kv)), per source and over all sources (source = 'all'); the inputs of qk_geometry.
-- Formula: over the n counted positions of a layer: unit_q_sq = ‖Σq̂‖², unit_k_sq = ‖Σk̂‖², unit_qk = ⟨Σq̂, Σk̂⟩, pair_cos = Σᵢ⟨q̂ᵢ, k̂ᵢ⟩, sum_q_sq = ‖Σq‖², sum_k_sq = ‖Σk‖², sum_qk = ⟨Σq, Σk⟩, norm_q_sq = Σ‖q‖², norm_k_sq = Σ‖k‖² (q, k after the rotary embedding, float64 sums; extract --attention)
-- Inputs: attention_totals
-- Columns: model, checkpoint, step, source, layer, head, kv_head, n, unit_q_sq, unit_k_sq, unit_qk, pair_cos, sum_q_sq, sum_k_sq, sum_qk, norm_q_sq, norm_k_sq
SELECT q.model, q.checkpoint, q.step, q.source, q.layer, q.head, q.kv_head, q.n,
       list_inner_product(q.sum_unit, q.sum_unit) AS unit_q_sq,
       list_inner_product(k.sum_unit, k.sum_unit) AS unit_k_sq,
       list_inner_product(q.sum_unit, k.sum_unit) AS unit_qk,
       q.pair_cos,
       list_inner_product(q.sum, q.sum) AS sum_q_sq,
       list_inner_product(k.sum, k.sum) AS sum_k_sq,
       list_inner_product(q.sum, k.sum) AS sum_qk,
       q.sum_sq AS norm_q_sq,
       k.sum_sq AS norm_k_sq
FROM attention_totals q
JOIN attention_totals k
  ON k.model = q.model AND k.checkpoint = q.checkpoint AND k.source = q.source AND k.layer = q.layer
 AND k.role = 'key' AND k.head = q.kv_head
WHERE q.role = 'query'
