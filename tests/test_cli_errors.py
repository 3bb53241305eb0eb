"""Every bad input to `kimi-linear` ends with one line saying what is wrong and what to do, and a non-zero exit;
no traceback. Plus the one case that warns and goes on (more new tokens than the context holds)."""

from __future__ import annotations

import math
import shutil

import pytest

from kimi_linear.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny checkpoint with a 64-token context."""
    path = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["init", str(path), "--context", "64"]) == 0
    return path


def one_line_error(capsys, argv: list[str]) -> str:
    """Runs the CLI; asserts a non-zero exit and exactly one non-empty stderr line, an `error: ` one."""
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc != 0, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_directory_without_config_json(tiny, tmp_path, capsys):
    (tmp_path / "weights-only").mkdir()
    shutil.copy(tiny / "model.safetensors", tmp_path / "weights-only")
    for argv in (["generate", "-m", str(tmp_path / "weights-only"), "x"],
                 ["generate", str(tmp_path / "weights-only"), "--prompt", "x"],
                 ["info", str(tmp_path / "weights-only")]):
        line = one_line_error(capsys, argv)
        assert "has no config.json" in line and "not a model checkpoint directory" in line


def test_checkpoint_without_a_tokenizer(tiny, tmp_path, capsys):
    shutil.copytree(tiny, tmp_path / "ckpt", ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    line = one_line_error(capsys, ["generate", "-m", str(tmp_path / "ckpt"), "x"])
    assert "has no tokenizer" in line and "copy in the tokenizer files" in line


@pytest.mark.parametrize("keep", [4, 100, 0.5])
def test_truncated_weights(tiny, tmp_path, capsys, keep):
    shutil.copytree(tiny, tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(int(size * keep) if isinstance(keep, float) else keep)
    line = one_line_error(capsys, ["generate", "-m", str(tmp_path / "ckpt"), "x"])
    assert "model.safetensors is truncated or corrupt" in line and "download or copy it again" in line


def test_init_into_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    line = one_line_error(capsys, ["init", str(tmp_path / "f")])
    assert "is a file, not a directory" in line


def test_info_unknown_preset_or_missing_path(tmp_path, capsys):
    line = one_line_error(capsys, ["info", "nosuchpreset"])
    assert "unknown preset 'nosuchpreset' (choose from tiny, small" in line
    line = one_line_error(capsys, ["info", str(tmp_path / "nope")])
    assert "does not exist" in line
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in one_line_error(capsys, ["info", str(tmp_path / "empty")])


@pytest.mark.parametrize("flags,flag", [
    (["-t", "-1"], "--temperature"), (["-t", "nan"], "--temperature"), (["-t", "inf"], "--temperature"),
    (["--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "--top-p"), (["--top-p", "nan"], "--top-p"),
    (["--top-k", "-2"], "--top-k"), (["-n", "-1"], "--max-new-tokens"), (["--seed", str(2**64)], "--seed"),
    (["--threads", "-1"], "--threads"),
])
def test_sampling_flags_are_checked_like_the_server(tiny, capsys, flags, flag):
    line = one_line_error(capsys, ["generate", "-m", str(tiny), "x", *flags])
    assert line.startswith(f"error: {flag} must be")


def test_more_new_tokens_than_the_context_warns_and_caps(tiny, capsys):
    """Chosen behaviour: a one-line warning saying where it is capped, then the tokens that fit (exit 0)."""
    capsys.readouterr()
    assert main(["generate", "-m", str(tiny), "ab", "-n", "100000", "--ignore-eos", "--no-stream"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "loading:" not in line]
    assert err[0] == ("warning: --max-new-tokens 100000 exceeds the context (2 prompt tokens, context 64): "
                      "capped at 62")
    assert "[2 prompt + 62 new tokens" in err[-1] and len(err) == 2


def test_info_prints_parameters_in_readable_units(capsys):
    assert main(["info", "tiny"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("parameters"))
    assert "1.22 M total" in line and "K active per token" in line
    assert main(["info", "kimi-linear-48b"]) == 0
    assert "49.1 B total" in capsys.readouterr().out


def test_human_count():
    from kimi_linear.model.memory import human_count

    assert [human_count(n) for n in (512, 1_220_000, 775_000, 49.1e9, math.pi * 1e12)] == [
        "512", "1.22 M", "775 K", "49.1 B", "3.14 T"]
