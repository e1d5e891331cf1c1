-- outlier_dims: each hidden dimension's share of the layer's total variance, and whether it is an outlier dimension.
-- Formula: share_i = C_ii / tr(C); z_i = (C_ii − mean_j C_jj)/std_j C_jj; is_outlier = z_i > 3 (variance more than 3 standard deviations above the mean)
-- Inputs: dim_variance
-- Columns: model, checkpoint, step, source, layer, dim, mean, variance, share, z, is_outlier
SELECT model, checkpoint, step, source, layer, dim, mean, variance,
       variance / sum(variance) OVER w AS share,
       (variance - avg(variance) OVER w) / nullif(stddev_pop(variance) OVER w, 0) AS z,
       coalesce((variance - avg(variance) OVER w) / nullif(stddev_pop(variance) OVER w, 0) > 3, false) AS is_outlier
FROM dim_variance
WINDOW w AS (PARTITION BY model, checkpoint, source, layer)
