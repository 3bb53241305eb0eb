"""What ``generate`` decodes with, resolved as transformers resolves it: keyword arguments over a passed
``GenerationConfig`` over the model's own (its checkpoint's ``generation_config.json``, else built from
``config.json``: EOS, PAD) over transformers' defaults (20 new tokens; when sampling, top-k 50).

Options of transformers' ``generate`` that this one does not implement (beam search, n-gram bans ...) are refused
with an error naming them when they would change the tokens, never silently ignored.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig

from .arg_checks import (
    MIN_TEMPERATURE,
    check_count,
    check_penalty,
    check_stop_strings,
    check_temperature,
    check_token_ids,
    check_top_k,
    check_top_p,
)

GENERATION_CONFIG_FILE = "generation_config.json"
# The options this generate implements, and their values when nobody sets them (transformers' global defaults).
DEFAULTS: dict[str, Any] = dict(
    max_new_tokens=None, max_length=None, min_new_tokens=None, min_length=0, do_sample=False, temperature=1.0,
    top_k=50, top_p=1.0, repetition_penalty=1.0, eos_token_id=None, pad_token_id=None, stop_strings=None,
)
# transformers' default: generate 20 new tokens when neither `max_new_tokens` nor `max_length` is set anywhere.
DEFAULT_NEW_TOKENS = 20
# transformers options that change the tokens, which this generate does not implement, at the values that leave
# the tokens alone (None is always neutral: unset).
UNSUPPORTED: dict[str, Any] = dict(
    num_beams=1, num_beam_groups=1, num_return_sequences=1, penalty_alpha=None, diversity_penalty=0.0,
    no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, encoder_repetition_penalty=1.0, bad_words_ids=None,
    force_words_ids=None, sequence_bias=None, min_p=None, typical_p=1.0, top_h=None, epsilon_cutoff=0.0,
    eta_cutoff=0.0, guidance_scale=1.0, forced_bos_token_id=None, forced_eos_token_id=None, suppress_tokens=None,
    begin_suppress_tokens=None, exponential_decay_length_penalty=None, renormalize_logits=False,
    remove_invalid_values=False, watermarking_config=None, prompt_lookup_num_tokens=None, max_time=None,
    return_dict_in_generate=False, constraints=None, logits_processor=None, stopping_criteria=None,
    assistant_model=None,
)
# Keyword arguments transformers' generate takes that do not change the tokens here: accepted and ignored.
IGNORED = frozenset({
    "use_cache", "bos_token_id", "decoder_start_token_id", "output_attentions", "output_hidden_states",
    "output_scores", "output_logits", "length_penalty", "early_stopping", "cache_implementation", "compile_config",
    "disable_compile", "synced_gpus", "token_type_ids",
})


@dataclass(frozen=True)
class GenerateOptions:
    """Resolved and checked. ``min_new_tokens``: EOS is masked out until that many tokens were generated;
    ``eos_token_id`` may be empty (no EOS); ``temperature`` only matters when ``do_sample``."""

    max_new_tokens: int
    min_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    eos_token_id: list[int]
    pad_token_id: int
    stop_strings: list[str]


def default_generation_config(config: Any) -> GenerationConfig:
    """A model's generation config when its checkpoint has no ``generation_config.json``: the special tokens of
    ``config.json`` (what transformers does)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GenerationConfig.from_model_config(config)


def read_generation_config(path: str) -> GenerationConfig | None:
    """The ``generation_config.json`` of checkpoint directory ``path``, or None when there is none."""
    file = os.path.join(path, GENERATION_CONFIG_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not readable JSON ({e}); fix or delete it") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    return GenerationConfig.from_dict(raw)


def generation_config_dict(gc: GenerationConfig) -> dict[str, Any]:
    """``generation_config.json`` content: the fields that differ from an empty config (as transformers writes)."""
    return json.loads(gc.to_json_string(use_diff=True))


def _unsupported(key: str, value: Any) -> bool:
    neutral = UNSUPPORTED[key]
    return value is not None and value != neutral and not (isinstance(value, (list, tuple, dict)) and not value)


def resolve_options(
    model_gc: GenerationConfig | None,
    user_gc: GenerationConfig | None,
    kwargs: dict[str, Any],
    prompt_len: int,
    vocab_size: int,
    has_tokenizer: bool,
) -> GenerateOptions:
    """``generate``'s keyword arguments (``kwargs``, explicitly given ones only) over ``user_gc`` (the
    ``generation_config=`` argument) over ``model_gc`` (the model's) over :data:`DEFAULTS` -> checked options.

    In a ``GenerationConfig`` None means unset (the next layer decides); an explicit ``eos_token_id=None``
    argument means no EOS. Bad values raise ``ValueError`` naming the argument (``generation_config.x`` when it came
    from a config)."""
    if user_gc is not None and not isinstance(user_gc, GenerationConfig):
        raise TypeError(f"`generation_config` must be a transformers.GenerationConfig, got {type(user_gc).__name__}")
    for key, value in kwargs.items():
        if key in UNSUPPORTED:
            if _unsupported(key, value):
                raise ValueError(f"`{key}`={value!r} is not supported by this generate (greedy or sampled "
                                 f"decoding of one sequence per prompt); supported: {', '.join(DEFAULTS)}")
        elif key not in DEFAULTS and key not in IGNORED:
            raise TypeError(f"generate() got an unexpected keyword argument {key!r}")
    for gc, origin in ((user_gc, "generation_config"), (model_gc, "the model's generation_config")):
        for key in UNSUPPORTED:
            value = getattr(gc, key, None) if gc is not None else None
            if key not in kwargs and _unsupported(key, value):
                message = (f"{origin}.{key}={value!r} is not supported by this generate; pass {key}="
                           f"{UNSUPPORTED[key]!r} to override it")
                if gc is user_gc:
                    raise ValueError(message)
                warnings.warn(f"{message} (ignored)", stacklevel=4)

    def pick(key: str) -> tuple[Any, str, bool]:
        """(value, name for errors, whether anyone set it)."""
        if key in kwargs:
            return kwargs[key], key, True
        for gc in (user_gc, model_gc):
            value = getattr(gc, key, None) if gc is not None else None
            if value is not None:
                return value, f"generation_config.{key}", True
        return DEFAULTS[key], key, False

    value, name, _ = pick("max_new_tokens")
    if value is not None:
        max_new = check_count(name, value)
    else:
        value, name, given = pick("max_length")
        if not given or value is None:
            max_new = DEFAULT_NEW_TOKENS
        else:
            if check_count(name, value, 1) <= prompt_len:
                raise ValueError(f"`{name}` ({value}) counts the prompt too and the prompt already has {prompt_len} "
                                 f"tokens: raise it, or set `max_new_tokens` instead")
            max_new = value - prompt_len
    value, name, _ = pick("min_new_tokens")
    if value is not None:
        min_new = check_count(name, value)
    else:
        value, name, _ = pick("min_length")
        min_new = max(0, check_count(name, value or 0) - prompt_len)

    do_sample, name, _ = pick("do_sample")
    if not isinstance(do_sample, bool):
        raise ValueError(f"`{name}` must be True or False, got {do_sample!r}")
    value, name, _ = pick("temperature")
    temperature = check_temperature(value, name)
    if do_sample and temperature == 0:
        raise ValueError(f"`{name}` must be > 0 when sampling (`do_sample=True`); for greedy decoding pass "
                         "do_sample=False")
    if temperature < MIN_TEMPERATURE:      # as the server: so small a temperature is greedy (and would overflow)
        do_sample = False
    value, name, _ = pick("top_k")
    top_k = max(0, check_top_k(value, name))
    value, name, _ = pick("top_p")
    top_p = check_top_p(value, name)
    value, name, _ = pick("repetition_penalty")
    penalty = check_penalty(value, name)

    value, name, _ = pick("eos_token_id")
    eos = check_token_ids(name, value, vocab_size)
    value, name, _ = pick("pad_token_id")
    if value is None:
        pad = eos[0] if eos else 0         # transformers pads finished rows with the (first) EOS then
    else:
        pad = check_token_ids(name, value, vocab_size)
        if len(pad) != 1:
            raise ValueError(f"`{name}` must be one token id, got {value!r}")
        pad = pad[0]
    value, name, _ = pick("stop_strings")
    stops = check_stop_strings(value, name)
    if stops and not has_tokenizer:
        raise ValueError(f"`{name}` needs the model's tokenizer to match text: pass `tokenizer=`")
    return GenerateOptions(max_new, min_new, do_sample, temperature, top_k, top_p, penalty, eos, pad, stops)
