-- qk_geometry: the geometry of each attention head's queries and keys (Godey et al. 2024, "Anisotropy Is Inherent to Self-Attention in Transformers"), all sources combined: their anisotropy, the mean query–key cosine, and how far both drift from the origin along shared directions.
-- Formula: over the n counted positions (after the rotary embedding; layer = the 0-based block, head = the query head, its key head h // (H / H_kv)): q_anisotropy = (‖Σq̂‖² − n)/(n² − n), k_anisotropy likewise on k̂ (Inter-Sim per head); qk_mean_cos = (⟨Σq̂, Σk̂⟩ − Σᵢ⟨q̂ᵢ, k̂ᵢ⟩)/(n² − n), the mean cos(qᵢ, kⱼ) over pairs i ≠ j; qk_drift_cos = ⟨Σq, Σk⟩/(‖Σq‖‖Σk‖), the cosine of the mean query and the mean key; q_drift_share = ‖Σq/n‖/√(Σ‖q‖²/n), k_drift_share likewise (1: every vector the mean; 0: mean zero); n ≥ 2
-- Inputs: qk_sums
-- Columns: model, checkpoint, step, layer, head, n, q_anisotropy, k_anisotropy, qk_mean_cos, qk_drift_cos, q_drift_share, k_drift_share, kv_head
SELECT model, checkpoint, step, layer, head, n,
       (unit_q_sq - n) / (CAST(n AS DOUBLE) * n - n) AS q_anisotropy,
       (unit_k_sq - n) / (CAST(n AS DOUBLE) * n - n) AS k_anisotropy,
       (unit_qk - pair_cos) / (CAST(n AS DOUBLE) * n - n) AS qk_mean_cos,
       sum_qk / NULLIF(sqrt(sum_q_sq) * sqrt(sum_k_sq), 0) AS qk_drift_cos,
       sqrt(sum_q_sq) / NULLIF(sqrt(n * norm_q_sq), 0) AS q_drift_share,
       sqrt(sum_k_sq) / NULLIF(sqrt(n * norm_k_sq), 0) AS k_drift_share,
       kv_head
FROM qk_sums
WHERE source = 'all' AND n >= 2
