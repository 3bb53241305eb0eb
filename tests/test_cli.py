"""The `kimi-linear` command line: init -> info -> generate, all offline, plus its error handling."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

from kimi_linear import KimiLinearForCausalLM
from kimi_linear.cli import main
from kimi_linear.model import preset_config
from kimi_linear.model.memory import cache_bytes
from kimi_linear.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    assert main(["init", path, "--preset", "tiny", "--seed", "3"]) == 0
    return path


def test_init_writes_a_loadable_checkpoint_and_tokenizer(tiny):
    files = set(os.listdir(tiny))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    model = KimiLinearForCausalLM.from_pretrained(tiny)
    assert json.load(open(os.path.join(tiny, "config.json")))["linear_attn_config"]["full_attn_layers"] == [4]
    tok = load_tokenizer(tiny)
    text = "héllo, wörld ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text      # byte-level: exact round trip
    assert tok.eos_token_id == model.config.eos_token_id == 256
    assert main(["init", tiny]) == 2  # refuses to overwrite without --force


def test_generate_streams_greedy_and_matches_the_api(tiny, capsys):
    assert main(["generate", tiny, "--prompt", "Hello", "-n", "12", "--ignore-eos"]) == 0
    streamed = capsys.readouterr().out
    model = KimiLinearForCausalLM.from_pretrained(tiny)
    tok = load_tokenizer(tiny)
    ids = tok("Hello", return_tensors="pt", add_special_tokens=False)["input_ids"]
    want = tok.decode(model.generate(ids, max_new_tokens=12, eos_token_id=None)[0, ids.shape[1]:])
    assert streamed.rstrip("\n") == want.rstrip("\n")


def test_generate_reads_stdin_and_samples_reproducibly(tiny, capsys, monkeypatch):
    outs = []
    for seed in (7, 7, 8):
        monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time"))
        assert main(["generate", tiny, "-n", "24", "-t", "1.5", "--top-p", "0.95", "--top-k", "50",
                     "--seed", str(seed), "--ignore-eos", "--no-stream"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] != outs[2]


def test_info_reports_layout_and_cache(tiny, capsys):
    assert main(["info", tiny, "--context", "8192"]) == 0
    out = capsys.readouterr().out
    cb = cache_bytes(preset_config("tiny"), 8192)
    assert "3 KDA + 1 MLA" in out and "4  MLA + MoE" in out
    assert f"{100 * cb.saving:.1f}%" in out


def test_cache_arithmetic_matches_spec_for_kimi_linear_48b():
    """docs/memory.md §2: at 1M tokens, 20 KDA layers ~41 MiB fixed, 7 MLA layers ~7.9 GiB, all-MLA ~30.4 GiB."""
    cb = cache_bytes(preset_config("kimi-linear-48b"), 1 << 20)
    assert (cb.kda_layers, cb.mla_layers) == (20, 7)
    assert cb.kda_state == 20 * (32 * 128 * 128 * 4 + 3 * 3 * 32 * 128 * 2)   # 2 MiB state + conv per layer
    assert cb.mla_latent == 7 * (1 << 20) * 576 * 2
    assert cb.all_mla == 27 * (1 << 20) * 576 * 2
    assert 0.73 < cb.saving < 0.75


def test_cli_errors_are_clear(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nope"), "-p", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["info", "no-such-preset"]) == 2
    assert "unknown preset 'no-such-preset'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "generate" in capsys.readouterr().out


def test_generate_half_precision(tmp_path, capsys):
    path = str(tmp_path / "bf16")
    assert main(["init", path, "--dtype", "bfloat16"]) == 0
    assert KimiLinearForCausalLM.from_pretrained(path, dtype="bfloat16").dtype == torch.bfloat16
    assert KimiLinearForCausalLM.from_pretrained(path).dtype == torch.float32      # auto on CPU: float32
    assert main(["generate", path, "-p", "abc", "-n", "4", "--ignore-eos"]) == 0
    assert main(["generate", path, "-p", "abc", "-n", "4", "--ignore-eos", "--dtype", "bfloat16"]) == 0
