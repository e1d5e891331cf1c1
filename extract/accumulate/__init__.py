"""Accumulation of the extraction pass: float64 sums of what a forward pass shows, added batch by
batch, layer by layer, so that shards, sources and machines merge.  One module per role, each
importing only those below it:

* sums.py — `TokenSums`: the per-(layer, token) sums of unit vectors and the hot path that adds them;
* tables.py — the slot table on one device (growth, budget, eviction by frequency), the host tier;
* spill.py — the disk tier: spill runs, their merging (the bound W ≤ 2.5 E), orphan sweeping;
* kernels.py — the per-layer arithmetic: the compiled GPU step, window sums, the per-window row terms;
* moments.py — `Moments`: n, Σh, Σhhᵀ and cross moments per layer, in a chosen product precision;
* by_type.py — layer 0's moments by token type where its rows are the input embedding's (`EmbeddingRows`);
* matmul.py — the moments' matrix-product back-ends (oneDNN, MKL, bf16 tensor cores);
* crew.py — `Crew`: a CPU's helper threads that run a layer's token sums and moments while the forward waits;
* background.py — the executors that run the moments off the forward's path (thread, CUDA stream);
* sample.py — `Sample`: the mergeable bottom-k sample of token vectors;
* attention.py — `AttentionSums`: per-head query/key sums of every block's attention;
* qk_kernels.py — their compiled GPU step (`qk_step`);
* sinks.py — the attention on each window's first token (a second score pass, log space);
* paths.py — the code paths taken, and the one-line warning for a slower one.

The per-window measures built on the same pass are `extract/sequences.py`.
"""

from .attention import AttentionSums
from .by_type import EmbeddingRows
from .moments import PRECISIONS, Moments
from .sample import Sample
from .spill import remove_orphans
from .sums import TokenSums

__all__ = ["AttentionSums", "EmbeddingRows", "PRECISIONS", "Moments", "Sample", "TokenSums", "remove_orphans"]
