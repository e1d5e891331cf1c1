-- qk_geometry_by_source: qk_geometry per text source (shards merged).
-- Formula: as qk_geometry, over the counted positions of one source: q_anisotropy = (‖Σq̂‖² − n)/(n² − n), k_anisotropy likewise, qk_mean_cos = (⟨Σq̂, Σk̂⟩ − Σᵢ⟨q̂ᵢ, k̂ᵢ⟩)/(n² − n), qk_drift_cos = ⟨Σq, Σk⟩/(‖Σq‖‖Σk‖), q_drift_share = ‖Σq/n‖/√(Σ‖q‖²/n), k_drift_share likewise; n ≥ 2
-- Inputs: qk_sums
-- Columns: model, checkpoint, step, source, layer, head, n, q_anisotropy, k_anisotropy, qk_mean_cos, qk_drift_cos, q_drift_share, k_drift_share, kv_head
SELECT model, checkpoint, step, source, layer, head, n,
       (unit_q_sq - n) / (CAST(n AS DOUBLE) * n - n) AS q_anisotropy,
       (unit_k_sq - n) / (CAST(n AS DOUBLE) * n - n) AS k_anisotropy,
       (unit_qk - pair_cos) / (CAST(n AS DOUBLE) * n - n) AS qk_mean_cos,
       sum_qk / NULLIF(sqrt(sum_q_sq) * sqrt(sum_k_sq), 0) AS qk_drift_cos,
       sqrt(sum_q_sq) / NULLIF(sqrt(n * norm_q_sq), 0) AS q_drift_share,
       sqrt(sum_k_sq) / NULLIF(sqrt(n * norm_k_sq), 0) AS k_drift_share,
       kv_head
FROM qk_sums
WHERE source <> 'all' AND n >= 2
