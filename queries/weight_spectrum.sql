-- weight_spectrum: the singular values of the embedding and unembedding matrices, raw and mean-centred (the softmax bottleneck: Godey et al. 2024).
-- Formula: singular_value_k = √λ_k, λ_k the eigenvalues of WᵀW (raw) or of (W − μ)ᵀ(W − μ) (centred; μ the mean row), descending, k = 1 … d; W (rows × d) as stored in the checkpoint (a tied unembedding is the embedding: tied = true)
-- Inputs: partition_fn
-- Columns: model, checkpoint, step, matrix, tied, centered, rows, k, singular_value
SELECT model, checkpoint, step, matrix, tied, centered, rows,
       CAST(row_number() OVER (PARTITION BY model, checkpoint, matrix, centered ORDER BY eigenvalue DESC) AS INTEGER) AS k,
       sqrt(greatest(eigenvalue, 0)) AS singular_value
FROM partition_fn
