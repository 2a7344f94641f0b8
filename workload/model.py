"""The model and its tokenizer.

``--model tiny`` builds a small model from a config, initialised from the seed: a BERT
encoder for classification, a GPT-2 decoder for causal-lm. Its tokenizer (WordPiece for
BERT, byte-level BPE for GPT-2) is trained on the job's training text with the
``tokenizers`` library and saved with the job and every checkpoint, so nothing is
downloaded. Any other value is a Hugging Face hub name (``bert-base-uncased``) or a local
directory in the same format, such as one of this job's checkpoints.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn

from .config import TrainConfig

log = logging.getLogger(__name__)

BERT_SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
GPT2_EOS = "<|endoftext|>"


class ModelError(ValueError):
    """The model or tokenizer cannot be built or loaded; the message says why."""


#: Characters kept in a tiny WordPiece vocabulary (the most frequent ones).
MAX_ALPHABET = 1000


def wordpiece_vocabulary(texts: Iterable[str], vocab_size: int) -> dict[str, int]:
    """A WordPiece vocabulary: special tokens, every character alone and as a ``##``
    continuation, then whole words by frequency, ties broken alphabetically.

    Deterministic by construction. ``tokenizers``' WordPieceTrainer is not: it breaks
    ties in Rust hash-map order, which is seeded per process, so two jobs with the same
    data and seed would get different vocabularies and so different models (and a
    resumed job could not match an uninterrupted one). Normalization and
    pre-tokenization are the library's BERT ones.
    """
    from tokenizers import normalizers, pre_tokenizers

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words: Counter[str] = Counter()
    for text in texts:
        normalized = normalizer.normalize_str(text)
        words.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalized))
    chars: Counter[str] = Counter()
    for word, count in words.items():
        for char in word:
            chars[char] += count
    alphabet = sorted(
        c for c, _ in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_ALPHABET]
    )
    tokens = [*BERT_SPECIAL, *alphabet, *(f"##{c}" for c in alphabet)]
    taken = set(tokens)
    for word, count in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(tokens) >= vocab_size or count < 2:
            break
        if word not in taken:
            tokens.append(word)
            taken.add(word)
    return {token: index for index, token in enumerate(tokens)}


def train_tiny_tokenizer(texts: Iterable[str], task: str, vocab_size: int) -> Any:
    """A fast tokenizer for ``texts``: BERT WordPiece or GPT-2 byte-level BPE.

    Both come out the same for the same text in every process (the byte-level BPE
    trainer of ``tokenizers`` is deterministic; the WordPiece vocabulary is built here).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers as tok_trainers
    from transformers import PreTrainedTokenizerFast

    if task == "classification":
        tok = Tokenizer(
            models.WordPiece(
                vocab=wordpiece_vocabulary(texts, vocab_size),
                unk_token="[UNK]",
                max_input_chars_per_word=100,
            )
        )
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
        )
        tok.decoder = decoders.WordPiece()
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="[UNK]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
            model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = tok_trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[GPT2_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=GPT2_EOS,
        eos_token=GPT2_EOS,
        unk_token=GPT2_EOS,
        pad_token=GPT2_EOS,
        model_input_names=["input_ids", "attention_mask"],
    )


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """Save to ``directory`` atomically (temporary directory, then rename)."""
    tmp = directory.parent / f".tmp-{directory.name}-{uuid.uuid4().hex[:8]}"
    try:
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_tokenizer(name_or_path: str, task: str, *, allow_download: bool = True) -> Any:
    """A saved tokenizer (directory or hub name); GPT-2-style ones get EOS as padding."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=not allow_download)
    except Exception as exc:  # hub, network and format failures all become one line
        raise ModelError(
            f"--model {name_or_path}: cannot load its tokenizer ({_first(exc)})"
        ) from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"--model {name_or_path}: the tokenizer has no pad or eos token")
        tokenizer.pad_token = tokenizer.eos_token
    if task == "causal-lm":
        tokenizer.padding_side = "right"
    return tokenizer


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def build_model(
    config: TrainConfig, tokenizer: Any, *, xla: bool = False, allow_download: bool = True
) -> nn.Module:
    """The model for ``config.task``, on the CPU (seed the RNG first: that is its init)."""
    # Eager attention under XLA traces to plain matmuls the Neuron compiler handles well.
    attn = "eager" if xla else "sdpa"
    if config.is_tiny:
        model = _build_tiny(config, tokenizer, attn)
    else:
        model = _load_pretrained(config, tokenizer, attn, allow_download=allow_download)
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(
        model.config, "n_positions", None
    )
    if limit is not None and config.max_length > limit:
        raise ModelError(
            f"--max-length {config.max_length} is longer than the model's {limit} positions"
        )
    # A small model trained from scratch on little data learns much faster without dropout.
    dropout = 0.0 if config.is_tiny and config.dropout < 0 else config.dropout
    if dropout >= 0:
        _set_dropout(model, dropout)
    # Training never reads the key/value cache; building it costs every decoder forward
    # time and memory (the Hugging Face Trainer turns it off the same way).
    model_config: Any = model.config
    if getattr(model_config, "use_cache", None):
        model_config.use_cache = False
    _settle_loss(model, config.task)
    return model


def _settle_loss(model: nn.Module, task: str) -> None:
    """Decide now what transformers would otherwise decide inside the first forward.

    Under ``torch.compile`` each costs the CUDA step (found in the H100 profile, README):

    - classification: ``BertForSequenceClassification.forward`` sets
      ``config.problem_type`` on its first call with labels; Dynamo's guard on it then fails
      at the second step and the forward compiles again. Integer labels over ``num_labels``
      classes are what the forward would pick: ``single_label_classification``.
    - causal-lm: ``PreTrainedModel.__init__`` sets ``loss_type`` from the class name, and
      ``GPT2LMHeadModel`` matches no entry of ``LOSS_MAPPING``; ``loss_function`` then logs a
      warning on every call (a graph break: Dynamo does not trace loggers) before falling
      back to ``ForCausalLM``, the loss it computes anyway.

    A value the model or its config already has is kept.
    """
    from transformers.loss.loss_utils import LOSS_MAPPING

    bare: Any = model  # a PreTrainedModel: its attributes are not nn.Module's
    if task == "classification" and getattr(bare.config, "problem_type", None) is None:
        bare.config.problem_type = "single_label_classification"
    if task == "causal-lm" and getattr(bare, "loss_type", None) not in LOSS_MAPPING:
        bare.loss_type = "ForCausalLM"


def _build_tiny(config: TrainConfig, tokenizer: Any, attn: str) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    positions = max(512, config.max_length)
    # The embedding has the configured size even when the trained vocabulary came out
    # smaller, so the graph shapes (and a compile cache) do not depend on the training text.
    vocab = max(len(tokenizer), config.tiny_vocab_size)
    # Keyword dicts: the config classes take these (and attn_implementation) as **kwargs.
    if config.task == "classification":
        bert: dict[str, Any] = {
            "vocab_size": vocab,
            "hidden_size": config.tiny_hidden_size,
            "num_hidden_layers": config.tiny_layers,
            "num_attention_heads": config.tiny_heads,
            "intermediate_size": 4 * config.tiny_hidden_size,
            "max_position_embeddings": positions,
            "pad_token_id": tokenizer.pad_token_id,
            "num_labels": 2,
            "attn_implementation": attn,
        }
        return BertForSequenceClassification(BertConfig(**bert))
    gpt2: dict[str, Any] = {
        "vocab_size": vocab,
        "n_embd": config.tiny_hidden_size,
        "n_layer": config.tiny_layers,
        "n_head": config.tiny_heads,
        "n_positions": positions,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "attn_implementation": attn,
    }
    return GPT2LMHeadModel(GPT2Config(**gpt2))


def _load_pretrained(
    config: TrainConfig, tokenizer: Any, attn: str, *, allow_download: bool
) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        if config.task == "classification":
            model = AutoModelForSequenceClassification.from_pretrained(
                config.model,
                num_labels=2,
                attn_implementation=attn,
                local_files_only=not allow_download,
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(
                config.model, attn_implementation=attn, local_files_only=not allow_download
            )
    except Exception as exc:  # hub, network and format failures all become one line
        raise ModelError(f"--model {config.model}: cannot load it ({_first(exc)})") from None
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise ModelError(
            f"--model {config.model}: the tokenizer has {len(tokenizer)} tokens, more than the "
            f"model's {model.get_input_embeddings().num_embeddings} embeddings"
        )
    return model


def _set_dropout(model: nn.Module, p: float) -> None:
    """Set every dropout probability of the model (config and modules) to ``p``."""
    for name in (
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "classifier_dropout",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "summary_first_dropout",
    ):
        if hasattr(model.config, name):
            setattr(model.config, name, p)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p
