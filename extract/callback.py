"""Isotropy during training: a `transformers.TrainerCallback` that probes the live model.

At every save (or every `every` steps) it runs the default extract pass over a fixed probe set (a
source, at most `max_tokens`) on the model being trained — eval mode, no autograd, RNG states and
train mode restored (extract/api.py's `probe_isotropy`) — commits checkpoint `step{global_step}`
with that step, and logs the headline numbers (`isotropy/inter_sim_last`, …) through the trainer's
loggers.  Only the main process probes (rank 0 of a DDP run holds the whole model; sharded models —
FSDP, DeepSpeed ZeRO-3 — are not supported).
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from common.errors import UserError

from .api import SETTING_DEFAULTS, make_sources, open_warehouse, probe_isotropy

LOG = logging.getLogger("isotropy_warehouse")


class IsotropyCallback(TrainerCallback):
    """Probe isotropy at every save (`every=None`) or every N optimizer steps.

    `source`: NAME=PATH as on the command line; `settings`: the extract command's options by their
    Python names.  The numbers reach the trainer's loggers (`Trainer.log`: report_to integrations,
    `state.log_history`) when the callback knows the trainer — `callback.attach(trainer)` or
    `trainer=` — else `state.log_history` and this module's logger; `history` keeps them too.

    Example: IsotropyCallback(tok, "probe=probe.txt", "warehouse", name="my-run", max_tokens=20_000).attach(trainer)
    """

    def __init__(self, tokenizer, source, warehouse, *, name: str, max_tokens: int | None = None,
                 every: int | None = None, trainer=None, **settings):
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise UserError(f"IsotropyCallback: every={every!r}: expected a number of steps ≥ 1 (or None: at every save)")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise UserError(f"IsotropyCallback: max_tokens={max_tokens!r}: expected a number of tokens ≥ 1")
        if not isinstance(name, str) or not name.strip():
            raise UserError(f"IsotropyCallback: name {name!r}: expected a non-empty name")
        if not isinstance(source, str):
            raise UserError("IsotropyCallback: source: expected a NAME=PATH string (as --source)")
        unknown = sorted(set(settings) - set(SETTING_DEFAULTS))
        if unknown:
            raise UserError(f"IsotropyCallback: unknown setting {unknown[0]!r} (settings are cli.py extract's options "
                            "by their Python names)")
        make_sources([source], {**SETTING_DEFAULTS, **settings}, None, "IsotropyCallback")  # a bad source: now
        open_warehouse(warehouse, "IsotropyCallback")  # a file, an unreachable or foreign warehouse: now, not at step N
        self.tokenizer, self.source, self.warehouse = tokenizer, source, warehouse
        self.name, self.max_tokens, self.every, self.trainer = name, max_tokens, every, trainer
        self.settings = settings
        self.history: list[dict] = []  # {"step": …, "isotropy/…": …} per probe

    def attach(self, trainer) -> "IsotropyCallback":
        """Add this callback to `trainer` and log through it; returns the callback."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every is not None and state.global_step % self.every == 0:
            self._probe(state, control, model, kwargs)

    def on_save(self, args, state, control, model=None, **kwargs):
        if self.every is None:
            self._probe(state, control, model, kwargs)

    def _probe(self, state, control, model, kwargs) -> None:
        if not state.is_world_process_zero or any(h["step"] == state.global_step for h in self.history):
            return
        tokenizer = self.tokenizer or kwargs.get("processing_class")
        numbers = probe_isotropy(model, tokenizer, self.source, self.warehouse, name=self.name,
                                 step=state.global_step, max_tokens=self.max_tokens, **self.settings)
        logs = {f"isotropy/{k}": v for k, v in numbers.items()}
        self.history.append({"step": state.global_step, **logs})
        if self.trainer is not None:
            keep = control.should_log  # Trainer.log clears it: the step's own loss line must still come
            self.trainer.log(dict(logs))
            control.should_log = keep
        else:
            state.log_history.append({**logs, "step": state.global_step})
            LOG.info("step %d: %s", state.global_step, ", ".join(f"{k} {v:.4f}" for k, v in logs.items()))
