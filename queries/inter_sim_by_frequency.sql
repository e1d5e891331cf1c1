-- inter_sim_by_frequency: Inter-Sim within frequency buckets of token types (Zhou et al.'s frequency distortion), sources combined: are rare tokens' vectors more alike than frequent ones'?
-- Formula: bucket of type t = ⌊log₂ n_t⌋ (n_t: its count over all sources); inter_sim = (‖Σ_{t∈bucket} S_t‖² − n)/(n² − n), S_t = Σû of type t (merged over partials), n = Σ_{t∈bucket} n_t; the bucket sums are gathered at commit while the merged vectors stream past (frequency_buckets)
-- Inputs: frequency_buckets
-- Columns: model, checkpoint, step, layer, bucket, types, n, inter_sim
SELECT model, checkpoint, step, layer, bucket, types, n,
       (sum_sq - n) / (CAST(n AS DOUBLE) * n - n) AS inter_sim
FROM frequency_buckets
WHERE source = 'all' AND n >= 2
