-- attention_sink: the mean attention each head puts on the first token of its window (Gu et al. 2025, "When Attention Sink Emerges in Language Models"), all sources combined (needs extract --attention-sinks).
-- Formula: sink_attention = Σᵢ A[i, 0] / n over the n query positions i ≥ 1 of every window (every non-padding position after the window's first; position 0 is the window's first, a BOS token where the tokenizer adds one), A = the head's softmax over the keys its mask allows, recomputed in log space; windows = windows counted, mean_window = n / windows + 1 (tokens per window: it matters), max_window = the longest; layer = the 0-based block, head = the query head
-- Inputs: attention_totals
-- Columns: model, checkpoint, step, layer, head, n, sink_attention, windows, mean_window, max_window
SELECT model, checkpoint, step, layer, head, sink_n AS n,
       sink_sum / sink_n AS sink_attention,
       sink_windows AS windows,
       CAST(sink_n AS DOUBLE) / sink_windows + 1 AS mean_window,
       sink_max_window AS max_window
FROM attention_totals
WHERE source = 'all' AND role = 'query' AND sink_n > 0
