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


# The special tokens each family's tokenizer adds around a text (its template).
TEMPLATES = {
    "bos": "<s> $A",  # Llama, Mistral, Gemma, Phi-3, Cohere, …
    "cls_sep": "[CLS] $A [SEP]",  # BERT, DistilBERT, Electra, DeBERTa-v2, ModernBERT
    "s_eos": "<s> $A </s>",  # RoBERTa, XLM-RoBERTa
    "eos_bos": "</s> $A",  # OPT prepends </s>
    "eos": "$A </s>",  # T5, mBART, Pegasus append </s>
    "none": "$A",  # GPT-NeoX, GPT-2, Qwen, BLOOM, …
}


def make_tokenizer(path: Path, kind: str = "bpe", texts: list[str] | None = None, template: str | None = None):
    """A fast tokenizer saved in `path`: byte-level BPE (decoders) or WordPiece (BERT-style),
    adding the special tokens of `template` (a key of TEMPLATES) by default."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = texts or corpus(200, seed=0)
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials = ["<|endoftext|>", "<|pad|>", "<s>", "</s>"]
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer)
        names = dict(eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|pad|>")
        if template in ("bos", "s_eos", "eos"):
            names.update(bos_token="<s>", eos_token="</s>")
        if template == "eos_bos":
            names.update(bos_token="</s>", eos_token="</s>")
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
        tok.train_from_iterator(texts, trainer)
        template = template or "cls_sep"
        names = dict(unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    if template and template != "none":
        single = TEMPLATES[template]
        used = [t for t in single.split() if t != "$A"]
        tok.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(t, tok.token_to_id(t)) for t in dict.fromkeys(used)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **names)
    fast.save_pretrained(path)
    return fast


# family → (tokenizer kind, template, extra config).  Every family the tests verify.
FAMILY_SPECS = {
    "gpt_neox": ("bpe", "none", {}),
    "gpt2": ("bpe", "none", {}),
    "opt": ("bpe", "eos_bos", {}),
    "llama": ("bpe", "bos", {}),
    "mistral": ("bpe", "bos", {"num_key_value_heads": 2}),
    "mixtral": ("bpe", "bos", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "falcon": ("bpe", "none", {}),
    "bloom": ("bpe", "none", {}),
    "gptj": ("bpe", "none", {"rotary_dim": 4}),
    "gpt_bigcode": ("bpe", "none", {}),
    "qwen2": ("bpe", "none", {"num_key_value_heads": 2}),
    "qwen3": ("bpe", "none", {"num_key_value_heads": 2, "head_dim": 8}),
    "gemma": ("bpe", "bos", {"head_dim": 8}),
    "gemma2": ("bpe", "bos", {"head_dim": 8, "sliding_window": 16}),
    "gemma3_text": ("bpe", "bos", {"head_dim": 8, "sliding_window": 16}),
    "phi": ("bpe", "none", {}),
    "phi3": ("bpe", "bos", {"pad_token_id": 1}),
    "olmo": ("bpe", "none", {}),
    "olmo2": ("bpe", "none", {}),
    "stablelm": ("bpe", "none", {}),
    "starcoder2": ("bpe", "none", {}),
    "cohere": ("bpe", "bos", {}),
    "bert": ("wordpiece", "cls_sep", {}),
    "roberta": ("bpe", "s_eos", {"pad_token_id": 1}),
    "xlm-roberta": ("bpe", "s_eos", {"pad_token_id": 1}),
    "distilbert": ("wordpiece", "cls_sep", {}),
    "electra": ("wordpiece", "cls_sep", {"embedding_size": 16}),
    "deberta-v2": ("wordpiece", "cls_sep", {}),
    "modernbert": ("wordpiece", "cls_sep", {"global_attn_every_n_layers": 1, "pad_token_id": 0,
                                            "cls_token_id": 2, "sep_token_id": 3}),
    # Encoder-decoders (their encoder is measured) and BART's decoder saved alone (BartForCausalLM).
    "t5": ("bpe", "eos", {"pad_token_id": 1, "eos_token_id": 3, "decoder_start_token_id": 1}),
    "bart": ("bpe", "s_eos", {"pad_token_id": 1}),
    "mbart": ("bpe", "eos", {"pad_token_id": 1}),
    "pegasus": ("bpe", "eos", {"pad_token_id": 1}),
    "bart-causal": ("bpe", "s_eos", {"pad_token_id": 1}),
}
ENCODERS = {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "deberta-v2", "modernbert"}
ENCODER_DECODERS = {"t5", "bart", "mbart", "pegasus"}
MODEL_TYPE = {"bart-causal": "bart"}  # a family whose config is another family's


def make_config(family: str, vocab: int, tied: bool, d: int = 32, layers: int = 2, context: int = 64, **extra):
    """A tiny config of any family through AutoConfig, with the generic names every config maps."""
    from transformers import AutoConfig

    h, ff = 4, 2 * d
    spec = dict(FAMILY_SPECS.get(family, ("bpe", "none", {}))[2])
    common = dict(vocab_size=vocab, tie_word_embeddings=tied, hidden_size=d, num_hidden_layers=layers,
                  num_attention_heads=h, num_key_value_heads=2, intermediate_size=ff,
                  max_position_embeddings=context)
    if family in ("gpt2", "gptj", "gpt_bigcode"):  # GPT-2-style names
        common.update(n_embd=d, n_layer=layers, n_head=h, n_positions=context)
    if family == "opt":
        common.update(ffn_dim=ff, word_embed_proj_dim=d)
    if family == "bloom":
        common.update(n_layer=layers, n_head=h)
    if family == "distilbert":
        common.update(dim=d, n_layers=layers, n_heads=h, hidden_dim=ff)
    if family in ("roberta", "xlm-roberta"):
        common.update(max_position_embeddings=context + 2)
    if family == "falcon":
        common.pop("intermediate_size")
    if family == "t5":
        common.update(d_kv=d // h, d_ff=ff, num_decoder_layers=layers)
    if MODEL_TYPE.get(family, family) in ("bart", "mbart", "pegasus"):
        common.update(decoder_layers=layers, decoder_attention_heads=h, encoder_ffn_dim=ff, decoder_ffn_dim=ff,
                      max_position_embeddings=context + 2)
    common.update(spec)
    common.update(extra)
    return AutoConfig.for_model(MODEL_TYPE.get(family, family), **common)


def make_model(path: Path, family: str, tied: bool, seed: int = 0, **kw) -> Path:
    """A random model of `family` with its family's tokenizer conventions, saved to `path` (safetensors)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    kind, template, _ = FAMILY_SPECS[family]
    tok = make_tokenizer(path, kind, template=template)
    config = make_config(family, len(tok), tied, **kw)
    torch.manual_seed(seed)
    auto = AutoModelForMaskedLM if family in ENCODERS else \
        AutoModelForSeq2SeqLM if family in ENCODER_DECODERS else AutoModelForCausalLM
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
