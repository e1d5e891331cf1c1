-- intrinsic_dim: TwoNN intrinsic dimension of the layer's bottom-k sample (needs extract --sample K).
-- Formula: μ = r₂/r₁ (two nearest neighbours), slope through 0 of −log(1 − F(μ)) on log μ. twonn: llm-microscope (centred, scaled by mean norm, μ ≤ 1 dropped, smallest n/5); twonn_skdim: scikit-dimension TwoNN (largest 10 % of μ discarded, F = i/N)
-- Inputs: layer_metrics
-- Columns: model, checkpoint, step, source, layer, sample_size, twonn, twonn_skdim
SELECT model, checkpoint, step, source, layer, sample_size, twonn, twonn_skdim
FROM layer_metrics
WHERE twonn IS NOT NULL
