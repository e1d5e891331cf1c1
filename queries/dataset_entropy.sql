-- dataset_entropy: how evenly a layer spreads the dataset's windows over directions (Skean et al. 2025, "Layer by Layer": dataset entropy with α = 1); 1 = uniform, near 0 = one direction.
-- Formula: ẑ_w = z_w/‖z_w‖, z_w the mean vector of window w, over the W windows with z_w ≠ 0; p = eig(Σ_w ẑ_w ẑ_wᵀ / W) (their sum is 1); dataset_entropy = −Σ p log p / log(min(W, d)). Not centred over the dataset, like Skean et al.'s code; theirs differs in z_w (the mean of the window's rows after normalize(): minus the window's mean, unit length — not a stored pooling) and clamps the W × W Gram matrix at 0 (no function of Σẑẑᵀ): docs/measures.md
-- Inputs: sequence_eigenvalues
-- Columns: model, checkpoint, step, source, layer, windows, dataset_entropy
WITH s AS (
    SELECT model, checkpoint, step, source, layer, windows, k, greatest(eigenvalue, 0) AS lam,
           max(k) OVER (PARTITION BY model, checkpoint, source, layer) AS d
    FROM sequence_eigenvalues
    WHERE pooling = 'normalized'
), p AS (
    SELECT *, lam / sum(lam) OVER (PARTITION BY model, checkpoint, source, layer) AS p FROM s
)
SELECT model, checkpoint, any_value(step) AS step, source, layer, any_value(windows) AS windows,
       CASE WHEN least(any_value(windows), any_value(d)) >= 2
            THEN -sum(CASE WHEN p > 0 THEN p * ln(p) ELSE 0 END) / ln(least(any_value(windows), any_value(d))) END AS dataset_entropy
FROM p
GROUP BY model, checkpoint, source, layer
