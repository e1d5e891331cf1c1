-- prompt_entropy: how evenly a window's vectors spread over directions (Skean et al. 2025, "Layer by Layer": prompt entropy with α = 1), averaged over windows; needs extract --prompt-entropy.
-- Formula: per window with N ≥ 2 vectors, Z = the vectors minus their mean, each row L2-normalised (zero rows dropped); p = eig(ZZᵀ)/tr(ZZᵀ); H = −Σ p log p / log(min(N, d)); prompt_entropy = the mean of H over those windows
-- Inputs: layer_totals
-- Columns: model, checkpoint, step, source, layer, windows, prompt_entropy
SELECT model, checkpoint, step, source, layer, pe_windows AS windows,
       pe_sum / nullif(pe_windows, 0) AS prompt_entropy
FROM layer_totals
WHERE pe_windows IS NOT NULL
