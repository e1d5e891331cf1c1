-- linearity: how linear the map from layer l to layer l + 1 is (Razzhigaev et al. 2024, "Your Transformer is Secretly Linear"; procrustes_similarity), exact over all tokens.
-- Formula: linearity = 1 − ‖X̃A − Ỹ‖²_F = tr(C_yx C_xx⁺ C_xy)/tr(C_yy) (X̃, Ỹ centred, Frobenius-normalised; A least squares); linearity_centered: the same between X and Y − X
-- Inputs: layer_metrics
-- Columns: model, checkpoint, step, source, layer, n, linearity, linearity_centered
SELECT model, checkpoint, step, source, layer, n, linearity, linearity_centered
FROM layer_metrics
WHERE linearity IS NOT NULL
