-- linearity: how linear the map from layer l to layer l + 1 is (Razzhigaev et al. 2024, "Your Transformer is Secretly Linear"; procrustes_similarity), exact over all tokens; with linear CKA (Kornblith et al. 2019) and the orthogonal Procrustes similarity of the same pair (needs extract --cross-moments).
-- Formula: linearity = 1 − ‖X̃A − Ỹ‖²_F = tr(C_yx C_xx⁺ C_xy)/tr(C_yy) (X̃, Ỹ centred, Frobenius-normalised; A least squares); linearity_centered: the same between X and Y − X; cka = ‖XᵀY‖²_F/(‖XᵀX‖_F‖YᵀY‖_F); procrustes_orthogonal = ‖XᵀY‖_*/(‖X‖_F‖Y‖_F); X, Y centred
-- Inputs: layer_metrics
-- Columns: model, checkpoint, step, source, layer, n, linearity, linearity_centered, cka, procrustes_orthogonal
SELECT model, checkpoint, step, source, layer, n, linearity, linearity_centered, cka, procrustes_orthogonal
FROM layer_metrics
WHERE linearity IS NOT NULL
