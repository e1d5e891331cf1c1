"""Train micro Pythia-style GPT-NeoX models on a text source, offline, saving HF checkpoints.

`train()` trains a byte-level BPE tokenizer on the source, then a GPT-NeoX language model
(rotary positions, parallel residual, LayerNorm: Pythia's layout) with tied or untied
embeddings, and saves `out/step0`, `out/step{k}`, … `out/step{steps}` with `save_pretrained`
(safetensors + tokenizer): a local model whose checkpoints `extract` reads like Pythia's
revisions.  `out/train.json` records the settings and the loss at every saved step; training
again with the same settings reuses the finished checkpoints.

With a `Probe` (`cli.py train --probe NAME=PATH`), every save step also runs the default extract
pass on the live model over the probe set (extract/api.py's `probe_isotropy`) and commits it as
checkpoint `step{k}` of the model `out`'s name — what `cli.py extract --model out` of the saved
checkpoint gives; `save=False` (`--no-checkpoints`) keeps only those probes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.errors import UserError
from common.progress import progress
from .sources import ReadStats, Source, documents


@dataclass(frozen=True)
class TrainSettings:
    tied: bool = False
    width: int = 128
    depth: int = 4
    heads: int = 4
    context: int = 128
    vocab: int = 4096
    steps: int = 600
    save_every: int = 60
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 0
    max_documents: int | None = None


@dataclass(frozen=True)
class Probe:
    """Isotropy in the loop: the probe set (NAME=PATH), at most `max_tokens` of it, into `warehouse`."""
    source: str
    warehouse: str
    max_tokens: int | None = 20_000


def _save_steps(s: TrainSettings) -> list[int]:
    return sorted({0, s.steps, *range(0, s.steps + 1, s.save_every)})


def finished(out: Path, settings: TrainSettings, source_fingerprint: str) -> bool:
    meta = out / "train.json"
    if not meta.exists():
        return False
    try:
        done = json.loads(meta.read_text())
    except ValueError:
        return False
    return (done.get("settings") == asdict(settings) and done.get("source_fingerprint") == source_fingerprint
            and all((out / f"step{k}" / "model.safetensors").exists() for k in _save_steps(settings)))


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|padding|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|padding|>", model_max_length=10**6)


_TOKENIZED: dict = {}  # the last (source, fingerprint, vocab, max_documents) → (tokenizer, token stream): models trained
# in turn on one source (the demo's tied and untied) share them


def tokenized(source: Source, source_fingerprint: str, vocab: int, max_documents: int | None):
    """(tokenizer trained on the source's documents, their token ids with EOS after each (N,) int64);
    the last one is kept for the next model on the same source (the result is deterministic)."""
    key = (repr(source), source_fingerprint, vocab, max_documents)
    if key not in _TOKENIZED:
        texts = [t for t in documents(source, (1, 1), ReadStats())]
        if max_documents:
            texts = texts[: max_documents]
        if not texts:
            raise UserError(f"--source {source.name}: no documents to train on")
        tok = train_tokenizer(texts, vocab)
        stream = []
        for ids in tok(texts, add_special_tokens=False)["input_ids"]:
            stream.extend(ids)
            stream.append(tok.eos_token_id)
        _TOKENIZED.clear()
        _TOKENIZED[key] = (tok, torch.tensor(stream, dtype=torch.long))  # (N,)
    return _TOKENIZED[key]


def train(source: Source, out: Path, settings: TrainSettings, source_fingerprint: str, log=print,
          probe: Probe | None = None, save: bool = True) -> dict:
    """Train (or reuse) one micro model; returns the train.json record.  `probe`: isotropy at every
    save step, in the loop (then the model is trained again even when finished: the probes need
    it live); `save`: write the stepN checkpoints."""
    import transformers
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    out = Path(out)
    if settings.width % settings.heads:
        raise UserError(f"--width {settings.width} must be a multiple of --heads {settings.heads}")
    if settings.steps < 1 or settings.save_every < 1:
        raise UserError("--steps and --save-every must be at least 1")
    if not save and probe is None:
        raise UserError("--no-checkpoints keeps nothing without --probe")
    if probe is not None and probe.max_tokens is not None and probe.max_tokens < 1:
        raise UserError("--probe-tokens must be at least 1")
    if probe is not None:  # a warehouse that cannot take the probes: now, not after the tokenizer and step 0
        from .api import open_warehouse

        open_warehouse(probe.warehouse, "--warehouse")
    if probe is None and save and finished(out, settings, source_fingerprint):
        log(f"{out}: already trained with these settings; reusing it")
        return json.loads((out / "train.json").read_text())
    torch.manual_seed(settings.seed)
    tok, data = tokenized(source, source_fingerprint, settings.vocab, settings.max_documents)
    eos = tok.eos_token_id
    if len(data) <= settings.context + 1:
        raise UserError(f"--source {source.name}: {len(data)} tokens is too little for --context {settings.context}")
    config = GPTNeoXConfig(
        vocab_size=len(tok), hidden_size=settings.width, num_hidden_layers=settings.depth,
        num_attention_heads=settings.heads, intermediate_size=4 * settings.width,
        max_position_embeddings=settings.context, rotary_pct=0.25, use_parallel_residual=True,
        tie_word_embeddings=settings.tied, bos_token_id=eos, eos_token_id=eos,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    model = GPTNeoXForCausalLM(config)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=settings.lr, betas=(0.9, 0.95))
    warmup = max(1, settings.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return settings.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, settings.steps - warmup)
        return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(settings.seed)
    save_at = set(_save_steps(settings))
    record = {"settings": asdict(settings), "source": source.name, "source_fingerprint": source_fingerprint,
              "tokens_in_source": len(data), "parameters": sum(p.numel() for p in model.parameters()),
              "checkpoints": {}}
    out.mkdir(parents=True, exist_ok=True)
    save_to_disk = save

    def save(step: int, loss: float | None) -> None:
        if save_to_disk:
            target = out / f"step{step}"
            model.save_pretrained(target)
            tok.save_pretrained(target)
        record["checkpoints"][f"step{step}"] = {"loss": loss}
        if probe is not None:  # the live model, in eval mode under no autograd; train mode and RNG restored
            from .api import probe_isotropy

            numbers = probe_isotropy(model, tok, probe.source, probe.warehouse, name=out.resolve().name, step=step,
                                     max_tokens=probe.max_tokens)
            record["checkpoints"][f"step{step}"]["isotropy"] = numbers
            log(f"{out.name} step{step}: " + ", ".join(f"{k} {v:.4f}" for k, v in numbers.items()))

    bar = progress(f"train {out.name}", total=settings.steps, unit="step",  # a bar on a terminal, else plain lines
                   per_unit=(settings.batch_size * settings.context, "tok"))
    start = time.perf_counter()
    loss_val = None
    for step in range(settings.steps + 1):
        if step in save_at:
            save(step, loss_val)
        if step == settings.steps:
            break
        offsets = torch.randint(0, len(data) - settings.context - 1, (settings.batch_size,), generator=gen)
        x = torch.stack([data[o: o + settings.context] for o in offsets.tolist()])  # (B, T)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = loss.item()
        bar.set_postfix(loss=f"{loss_val:.3f}", refresh=False)
        bar.update(1)
    bar.close()
    record["seconds"] = round(time.perf_counter() - start, 1)
    if save_to_disk:  # train.json says the checkpoints are there (`save` is the function above: always true)
        (out / "train.json").write_text(json.dumps(record, indent=1))
    log(f"{out}: trained {settings.steps} steps in {record['seconds']} s, final loss {loss_val:.3f}, "
        f"{len(record['checkpoints'])} checkpoints")
    return record
