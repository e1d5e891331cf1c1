-- attention_sink_rate: the share of attention heads that are sinks (Gu et al. 2025's sink rate at ε = 0.3): heads whose mean attention on the first token exceeds ε, per checkpoint, all sources combined.
-- Formula: sink_rate = |{(layer, head): sink_attention > 0.3}| / |{(layer, head)}| over every head of every block in attention_sink; another ε: SELECT model, checkpoint, avg(CAST(sink_attention > 0.5 AS DOUBLE)) FROM attention_sink GROUP BY model, checkpoint
-- Inputs: attention_sink
-- Columns: model, checkpoint, step, heads, sink_heads, sink_rate, mean_window
SELECT model, checkpoint, any_value(step) AS step, count(*) AS heads,
       count(*) FILTER (WHERE sink_attention > 0.3) AS sink_heads,
       avg(CAST(sink_attention > 0.3 AS DOUBLE)) AS sink_rate,
       any_value(mean_window) AS mean_window
FROM attention_sink
GROUP BY model, checkpoint
