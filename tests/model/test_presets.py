"""Presets: a caller's field overrides win over everything a preset sets, its special token ids included."""

from __future__ import annotations

import pytest

from kimi_linear.model import preset_config


@pytest.mark.parametrize("name", ["tiny", "small", "kimi-linear-48b", "k3-tiny", "kimi-k3"])
def test_overrides_win_over_the_preset_token_ids(name):
    default = preset_config(name)
    assert default.vocab_size > max(default.pad_token_id, default.bos_token_id, default.eos_token_id)
    c = preset_config(name, vocab_size=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert (c.vocab_size, c.pad_token_id, c.bos_token_id, c.eos_token_id) == (4096, 0, 1, 2)
