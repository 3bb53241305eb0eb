"""Tokenizers for Kimi Linear checkpoints: a download-free byte-level one for fresh checkpoints, and loading the
published one (tiktoken-based, remote code shipped inside the checkpoint directory) strictly offline."""

from __future__ import annotations

import json
import os
import sys

EOS, BOS, PAD = "<|endoftext|>", "<|bos|>", "<|pad|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_level_tokenizer():
    """A ``PreTrainedTokenizerFast`` whose ids 0-255 are raw bytes (any text round-trips), then
    ``<|endoftext|>`` = 256 (eos), ``<|bos|>`` = 257, ``<|pad|>`` = 258; pads on the left for batched generation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS, BOS, PAD])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=BOS, pad_token=PAD,
                                   padding_side="left")


def id_tokenizer(vocab_size: int):
    """A ``PreTrainedTokenizerFast`` for models whose tokens are bare ids (the synthetic tasks of ``kimi-linear
    train``): token i is written as the number ``i``, text is numbers separated by whitespace (``"3 260 17"``), and
    decoding joins them with spaces. No special tokens: such a task has no end-of-sequence."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 1:
        raise ValueError(f"`vocab_size` must be positive, got {vocab_size}")
    tok = Tokenizer(models.WordLevel(vocab={str(i): i for i in range(vocab_size)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="left")


def has_tokenizer(path: str) -> bool:
    """Whether checkpoint directory ``path`` holds tokenizer files (``tokenizer.json`` or ``tokenizer_config.json``)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def load_tokenizer(path: str):
    """Load the tokenizer saved in checkpoint directory ``path`` without touching the network.

    The published Kimi-Linear tokenizer is tiktoken-based and ships its code in the directory
    (``tokenizer_config.json`` ``auto_map``); that local code is trusted, never fetched.
    """
    from transformers import AutoTokenizer

    if not has_tokenizer(path):
        raise FileNotFoundError(f"{path} has no tokenizer (tokenizer.json or tokenizer_config.json): copy in the "
                                "tokenizer files of the model or data it was trained on (checkpoints that "
                                "`kimi-linear train` writes now carry them)")
    cfg_file = os.path.join(path, "tokenizer_config.json")
    remote = False
    if os.path.isfile(cfg_file):
        with open(cfg_file, encoding="utf-8") as f:
            auto_map = json.load(f).get("auto_map") or {}
        refs = [v for v in (auto_map.get("AutoTokenizer") or []) if v] if isinstance(auto_map, dict) else []
        remote = bool(refs)
        for ref in refs:
            module = ref.split(".")[0]
            if "--" in ref or not os.path.isfile(os.path.join(path, module + ".py")):
                raise FileNotFoundError(f"tokenizer code {ref!r} named in {cfg_file} is not in {path!r}; "
                                        "kimi-linear never downloads code at run time")
    if remote:
        try:
            import tiktoken  # noqa: F401
        except ImportError as e:
            raise ImportError("this checkpoint's tokenizer needs `tiktoken`: pip install tiktoken") from e
        print(f"note: using the tokenizer code shipped in {path}", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=remote, local_files_only=True)
    tok.padding_side = "left"
    return tok
