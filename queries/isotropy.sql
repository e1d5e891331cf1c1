-- isotropy: the partition-function isotropy I(W) of the embedding and unembedding matrices, raw and mean-centred.
-- Formula: I(W) = min_c Z(c) / max_c Z(c), Z(c) = Σ_i exp⟨c, W_i⟩, c ∈ {±eigenvectors of WᵀW} (log-space); i_w_eigh_signs: c with eigh's signs only, Z in float32 (the authors' script); tied = true where the unembedding is the embedding (both rows then hold the same matrix, as in weight_spectrum)
-- Inputs: partition_fn
-- Columns: model, checkpoint, step, matrix, tied, centered, i_w, i_w_eigh_signs
SELECT model, checkpoint, any_value(step) AS step, matrix, bool_and(tied) AS tied, centered,
       exp(min(least(log_z_pos, log_z_neg)) - max(greatest(log_z_pos, log_z_neg))) AS i_w,
       min(z_eigh_sign) / max(z_eigh_sign) AS i_w_eigh_signs
FROM partition_fn
GROUP BY model, checkpoint, matrix, centered
