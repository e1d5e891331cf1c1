-- qk_direction: each query head's dominant direction (Godey et al. 2025, "Q-Filters"): the top eigenvector v of the uncentred second moment of its queries, its share, and the signs of the query and key means along it (needs extract --attention-moments).
-- Formula: v = the top eigenvector of Σqqᵀ/n (queries after the rotary embedding), oriented so that ⟨mean q, v⟩ ≥ 0; top_share = λ_max / Σλ = λ_max / (Σ‖q‖²/n); q_mean_along = ⟨Σq/n, v⟩, k_mean_along = ⟨Σk/n, v⟩ for the head's key head; q_mean_sign, k_mean_sign their signs, epsilon = q_mean_sign · k_mean_sign (Q-Filters' ε, from the means: their majority vote over the queries' signs needs a second pass); per source and over all sources (source = 'all')
-- Inputs: attention_direction
-- Columns: model, checkpoint, step, source, layer, head, kv_head, n, top_share, q_mean_along, k_mean_along, q_mean_sign, k_mean_sign, epsilon
SELECT model, checkpoint, step, source, layer, head, kv_head, n,
       eigenvalue / NULLIF(trace, 0) AS top_share,
       q_mean_along, k_mean_along,
       CAST(sign(q_mean_along) AS INTEGER) AS q_mean_sign,
       CAST(sign(k_mean_along) AS INTEGER) AS k_mean_sign,
       CAST(sign(q_mean_along) * sign(k_mean_along) AS INTEGER) AS epsilon
FROM attention_direction
