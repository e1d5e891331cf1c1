"""Tiny random models and tokenizers, built in the test and saved with `save_pretrained`,
so that tests load them back through the same path a user's model takes."""

from __future__ import annotations

import random
from pathlib import Path

import torch

WORDS = (
    "the a of to and in is was for on that with as by at from it an be this which or are were "
    "model layer token vector space cosine isotropy norm gain bias weight matrix training step "
    "language transformer attention head embedding sentence document corpus source shard sum mean "
    "Alice Bob river mountain quickly slowly green blue seven eleven 42 3.14 data parquet query"
).split()


def corpus(n_docs: int, seed: int, sentences: tuple[int, int] = (1, 4)) -> list[str]:
    """Deterministic pseudo-English documents with a Zipf-like word distribution."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(len(WORDS))]
    docs = []
    for _ in range(n_docs):
        sents = []
        for _ in range(rng.randint(*sentences)):
            words = rng.choices(WORDS, weights, k=rng.randint(3, 14))
            sents.append(" ".join(words).capitalize() + rng.choice([".", ".", "!", "?"]))
        docs.append(" ".join(sents))
    return docs


def make_tokenizer(path: Path, kind: str = "bpe", texts: list[str] | None = None):
    """A fast tokenizer saved in `path`: byte-level BPE (decoders) or WordPiece (BERT-style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = texts or corpus(200, seed=0)
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|pad|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                       bos_token="<|endoftext|>", pad_token="<|pad|>")
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
        tok.train_from_iterator(texts, trainer)
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                       cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(path)
    return fast


def make_config(family: str, vocab: int, tied: bool, d: int = 32, layers: int = 2, context: int = 64):
    from transformers import (BertConfig, FalconConfig, GPT2Config, GPTNeoXConfig, LlamaConfig,
                              MistralConfig, OPTConfig, RobertaConfig)

    h, ff = 4, 2 * d
    common = dict(vocab_size=vocab, tie_word_embeddings=tied)
    return {
        "gpt_neox": lambda: GPTNeoXConfig(hidden_size=d, num_hidden_layers=layers, num_attention_heads=h,
                                          intermediate_size=ff, max_position_embeddings=context, **common),
        "gpt2": lambda: GPT2Config(n_embd=d, n_layer=layers, n_head=h, n_positions=context, **common),
        "opt": lambda: OPTConfig(hidden_size=d, num_hidden_layers=layers, num_attention_heads=h, ffn_dim=ff,
                                 max_position_embeddings=context, word_embed_proj_dim=d, **common),
        "llama": lambda: LlamaConfig(hidden_size=d, num_hidden_layers=layers, num_attention_heads=h,
                                     intermediate_size=ff, max_position_embeddings=context, **common),
        "mistral": lambda: MistralConfig(hidden_size=d, num_hidden_layers=layers, num_attention_heads=h,
                                         num_key_value_heads=2, intermediate_size=ff,
                                         max_position_embeddings=context, **common),
        "falcon": lambda: FalconConfig(hidden_size=d, num_hidden_layers=layers, num_attention_heads=h,
                                       max_position_embeddings=context, **common),
        "bert": lambda: BertConfig(hidden_size=d, num_hidden_layers=layers, num_attention_heads=h,
                                   intermediate_size=ff, max_position_embeddings=context, **common),
        "roberta": lambda: RobertaConfig(hidden_size=d, num_hidden_layers=layers, num_attention_heads=h,
                                         intermediate_size=ff, max_position_embeddings=context + 2,
                                         pad_token_id=0, **common),
    }[family]()


def make_model(path: Path, family: str, tied: bool, seed: int = 0, **kw) -> Path:
    """A random model of `family` with its tokenizer, saved to `path` (safetensors)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    kind = "wordpiece" if family in ("bert", "roberta") else "bpe"
    tok = make_tokenizer(path, kind)
    config = make_config(family, len(tok), tied, **kw)
    torch.manual_seed(seed)
    auto = AutoModelForMaskedLM if family in ("bert", "roberta") else AutoModelForCausalLM
    model = auto.from_config(config)
    with torch.no_grad():  # give norms non-trivial gains and biases, as trained models have
        for name, p in model.named_parameters():
            if "norm" in name.lower() or "ln" in name.lower():
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def write_sources(directory: Path) -> dict[str, Path]:
    """Two text sources in two formats (txt, jsonl.zst)."""
    import json

    import zstandard

    directory.mkdir(parents=True, exist_ok=True)
    a = directory / "alpha.txt"
    a.write_text("\n".join(corpus(24, seed=1)) + "\n")
    b = directory / "beta.jsonl.zst"
    lines = "".join(json.dumps({"text": t, "meta": {"pile_set_name": "Beta"}}) + "\n" for t in corpus(20, seed=2))
    b.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    return {"alpha": a, "beta": b}
