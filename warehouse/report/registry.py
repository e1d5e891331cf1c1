"""The report's figures, in the order the page shows them: each a function of the views (`Data`)
that returns a `Figure`, drawn or with a line saying why not.
"""

from __future__ import annotations

from .attention_figures import fig_qk_drift_layers, fig_qk_drift_training, fig_sink_layers, fig_sink_rate_training
from .change_figures import fig_block_influence_layers, fig_block_influence_training, fig_random_word_sim_layers
from .paper_figures import (fig_avg_intra_layers, fig_avg_intra_training, fig_by_source, fig_heatmap,
                            fig_inter_sim_layers, fig_inter_sim_training, fig_isotropy, fig_isotropy_training,
                            fig_layernorm, fig_layernorm_training, fig_tokens)
from .peer_figures import (MEASURES, fig_anisotropy_layers, fig_anisotropy_training, fig_dim_contrib, fig_drift_layers,
                           fig_drift_training, fig_inter_sim_by_frequency, fig_intrinsic_dim_layers,
                           fig_intrinsic_dim_training, fig_linearity_layers, fig_massive_layers, fig_massive_training,
                           fig_sequence_rank_layers, fig_sequence_rank_training, fig_similarity_layers,
                           fig_weight_spectrum, fig_weight_spectrum_training)

FIGURES = [
    fig_inter_sim_layers, fig_avg_intra_layers, fig_inter_sim_training, fig_avg_intra_training,
    lambda d: fig_isotropy(d, "unembedding", 5), lambda d: fig_isotropy(d, "embedding", 6),
    fig_isotropy_training, fig_layernorm, fig_layernorm_training, fig_heatmap, fig_by_source, fig_tokens,
    fig_anisotropy_layers, fig_anisotropy_training, fig_intrinsic_dim_layers, fig_intrinsic_dim_training,
    fig_linearity_layers, fig_dim_contrib, fig_drift_layers, fig_drift_training, fig_inter_sim_by_frequency,
    fig_similarity_layers, fig_block_influence_layers, fig_block_influence_training, fig_random_word_sim_layers,
    MEASURES[0].by_layer, MEASURES[0].training, MEASURES[1].by_layer, MEASURES[1].training,
    fig_massive_layers, fig_massive_training, fig_weight_spectrum, fig_weight_spectrum_training,
    fig_sequence_rank_layers, fig_sequence_rank_training,
    *[f for m in MEASURES[2:] for f in (m.by_layer, m.training)],
    fig_qk_drift_layers, fig_qk_drift_training, fig_sink_layers, fig_sink_rate_training,
]
