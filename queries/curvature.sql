-- curvature: how sharply a window's trajectory through a layer's space turns from token to token (Hosseini & Fedorenko 2023; Skean et al. 2025); 0 = straight.
-- Formula: per window, v_k = h_{k+1} − h_k over consecutive vectors (counted, finite, non-zero; an excluded vector breaks the chain), c_k = arccos(|⟨v_k, v_{k+1}⟩| / (‖v_k‖‖v_{k+1}‖)) over pairs with non-zero norms, the window's mean c_k (radians); curvature = the mean over windows with ≥ 1 such pair (windows)
-- Inputs: layer_totals
-- Columns: model, checkpoint, step, source, layer, windows, curvature
SELECT model, checkpoint, step, source, layer, curv_windows AS windows,
       curv_sum / nullif(curv_windows, 0) AS curvature
FROM layer_totals
WHERE curv_windows IS NOT NULL
