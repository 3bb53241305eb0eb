"""The default model shipped in the package (src/kimi_linear/assets/default) and the script that trains it.

The shipped-model tests skip only while the asset directory is absent or empty (before the GPU run); once any
file is there they run, and an incomplete, oversized or untrained default fails them (its speed is measured by
``bench/default_cli.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_linear.model import default

ROOT = Path(__file__).resolve().parents[1]
ASSETS = default.ASSET_DIR
MiB = 1 << 20
shipped = pytest.mark.skipif(not ASSETS.is_dir() or not any(ASSETS.iterdir()),
                             reason=f"default model not trained yet (no files in {ASSETS})")


def load_train_default():
    spec = importlib.util.spec_from_file_location("bench_train_default", ROOT / "bench" / "train_default.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------- the training script on CPU
@pytest.mark.slow
def test_train_default_smoke_run_writes_a_shippable_checkpoint(tmp_path, capsys):
    from kimi_linear.cli import main as cli
    from kimi_linear.model import load_config
    from kimi_linear.model.memory import parameter_counts

    td = load_train_default()
    out = tmp_path / "default"
    common = ["--max-files", "6", "--seq-len", "64", "--batch-size", "2", "--eval-rows", "2", "--steps", "2",
              "--minutes", "0", "--eval-every", "1"]
    assert td.main([*common, "--out", str(out)]) == 0
    assert td.main([*common, "--variant", "mla", "--out", str(tmp_path / "mla")]) == 0
    printed = capsys.readouterr().out
    assert "reusing" in printed                                      # the second variant reused the tokenizer
    assert default.missing_files(out) == []
    assert all(f.stat().st_size < 16 * MiB for f in out.iterdir())
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 2 and log["stopped_by"] == "steps" and log["card"]
    assert log["tokens_seen"] > 0 and [e["step"] for e in log["eval_curve"]] == [1, 2]
    assert log["held_out_loss"] > 0 and log["held_out_bits_per_byte"] > 0 and "train_minutes" in log
    mla = json.loads((tmp_path / "mla" / "train_log.json").read_text())
    assert (mla["steps"], mla["hyperparameters"]) == (log["steps"], log["hyperparameters"])
    config, twin = load_config(out), load_config(tmp_path / "mla")
    assert config.layer_types.count("linear_attention") == 3 * config.layer_types.count("full_attention")
    assert set(twin.layer_types) == {"full_attention"} and twin.hidden_size == config.hidden_size
    assert parameter_counts(config)["total"] <= 15_000_000
    assert (tmp_path / "stdlib-corpus").is_dir()
    assert cli(["generate", "-m", str(out), "def f(x):", "-n", "3", "--ignore-eos", "--no-stream"]) == 0


def test_the_shipped_shape_is_a_15m_kimi_linear_with_moe():
    from transformers import PreTrainedTokenizerFast

    from kimi_linear.model.memory import parameter_counts

    td = load_train_default()
    tok = PreTrainedTokenizerFast(tokenizer_object=_tokenizer(4096), eos_token="<e>", bos_token="<b>",
                                  pad_token="<p>")
    config = td.model_config("default", tok)
    counts = parameter_counts(config)
    assert 12e6 < counts["total"] <= 15e6, counts                    # embeddings and lm_head counted, untied
    assert "sparse" in config.mlp_layer_types and config.num_local_experts == 8
    with pytest.raises(ValueError, match="`variant`"):
        td.model_config("gdn", tok)


def _tokenizer(n: int):
    from tokenizers import Tokenizer, models

    vocab = {f"<{t}>": i for i, t in enumerate("ebp")} | {f"t{i}": i + 3 for i in range(n - 3)}
    return Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))


# ------------------------------------------------------------------------------------------------ the shipped files
@shipped
def test_shipped_files_are_complete_small_and_documented():
    from kimi_linear.model import load_config
    from kimi_linear.model.memory import parameter_counts

    assert default.missing_files(ASSETS) == []
    assert all(f.stat().st_size < 16 * MiB for f in ASSETS.iterdir())
    config = load_config(ASSETS)
    assert parameter_counts(config)["total"] <= 15_500_000
    assert "linear_attention" in config.layer_types and "full_attention" in config.layer_types
    assert "sparse" in config.mlp_layer_types
    log = json.loads((ASSETS / "train_log.json").read_text())
    for key in ("command", "steps", "tokens_seen", "train_minutes", "card", "held_out_loss"):
        assert key in log, key


@shipped
def test_shipped_model_is_trained_on_python():
    """Held-out stdlib text (files the training never saw) costs far less than the uniform ln(vocab)."""
    import math

    import torch

    from kimi_linear import KimiLinearForCausalLM
    from kimi_linear.model.tokenizer import load_tokenizer
    from kimi_linear.train.corpus import read_texts, split_files, stdlib_files

    tok = load_tokenizer(str(ASSETS))
    model = KimiLinearForCausalLM.from_pretrained(ASSETS, dtype=torch.float32)
    _, held = split_files(stdlib_files())
    text = "".join(read_texts(held[:3]))[:6000]
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :1024]
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    loss = torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:]).item()
    assert loss < 0.5 * math.log(model.config.vocab_size), loss


@shipped
def test_generate_with_only_a_prompt_writes_code():
    """`kimi-linear generate "def fibonacci(n):"`: offline, CPU, 2 threads, 64 tokens of code-like text. (Its
    speed goal, the whole command under 10 s on 2 cores, is a benchmark's: `python bench/default_cli.py`; a test
    must not depend on how loaded the machine is.)"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "kimi_linear.cli", "generate", "def fibonacci(n):", "--threads", "2", "-n", "64",
           "--ignore-eos"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "64 new tokens" in run.stderr
    code = sum(out.count(s) for s in ("(", ")", ":", "=", "\n", "return", "if ", "self", "def "))
    assert code >= 5 and sum(c.isprintable() or c.isspace() for c in out) >= 0.95 * len(out), out
