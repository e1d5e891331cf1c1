-- layernorm: summaries of every LayerNorm/RMSNorm's gain g and bias b (bias columns NULL for RMSNorm).
-- Formula: avgnorm(v) = ‖v‖/√d; b_g_ratio = ‖b‖/‖g‖; sum_b_over_g = Σ b_i/g_i (Eq. 9); g′ = (1/g_1 … 1/g_d); b_parallel_norm = |b·g′|/‖g′‖; b_perp_norm = ‖b − (b·g′/‖g′‖²) g′‖
-- Inputs: norm_params
-- Columns: model, checkpoint, step, module, is_final, avgnorm_g, avgnorm_b, b_g_ratio, sum_b_over_g, b_parallel_norm, b_perp_norm
WITH per_module AS (
    SELECT model, checkpoint, module,
           sum(bias / gain) / sum(1 / (gain * gain)) AS alpha
    FROM norm_params
    GROUP BY model, checkpoint, module
)
SELECT p.model, p.checkpoint, any_value(p.step) AS step, p.module, any_value(p.is_final) AS is_final,
       sqrt(sum(p.gain * p.gain) / count(*)) AS avgnorm_g,
       sqrt(sum(p.bias * p.bias) / count(*)) AS avgnorm_b,
       sqrt(sum(p.bias * p.bias) / sum(p.gain * p.gain)) AS b_g_ratio,
       sum(p.bias / p.gain) AS sum_b_over_g,
       abs(sum(p.bias / p.gain)) / sqrt(sum(1 / (p.gain * p.gain))) AS b_parallel_norm,
       sqrt(sum((p.bias - m.alpha / p.gain) * (p.bias - m.alpha / p.gain))) AS b_perp_norm
FROM norm_params p
JOIN per_module m ON p.model = m.model AND p.checkpoint = m.checkpoint AND p.module = m.module
GROUP BY p.model, p.checkpoint, p.module
