-- anisotropy: Razzhigaev et al. (2024, "The Shape of Learning"; llm-microscope calculate_anisotropy_torch): the share of variance on the first principal axis.
-- Formula: anisotropy = λ_max / Σλ, λ = eigenvalues of the covariance of the layer's (centred) hidden states
-- Inputs: spectrum
-- Columns: model, checkpoint, step, source, layer, n, anisotropy
SELECT model, checkpoint, any_value(step) AS step, source, layer, any_value(n) AS n,
       max(eigenvalue) / sum(eigenvalue) AS anisotropy
FROM spectrum
GROUP BY model, checkpoint, source, layer
