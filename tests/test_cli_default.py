"""`kimi-linear generate` / `serve` without a model directory use the default model shipped in the package; here the
default's location is pointed at a temporary tiny checkpoint (the same code path as the real files)."""

from __future__ import annotations

import argparse
import io

import pytest

from kimi_linear.cli import build_parser, generate_inputs, main
from kimi_linear.model import default


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("default") / "ckpt")
    assert main(["init", path, "--preset", "tiny", "--seed", "5"]) == 0
    return path


@pytest.fixture
def shipped(tiny, monkeypatch):
    monkeypatch.setattr(default, "ASSET_DIR", default.Path(tiny))
    return tiny


@pytest.fixture
def not_installed(tmp_path, monkeypatch):
    monkeypatch.setattr(default, "ASSET_DIR", tmp_path / "assets" / "default")


def gen(capsys, *argv: str) -> str:
    assert main(["generate", *argv, "-n", "6", "--ignore-eos", "--no-stream"]) == 0
    return capsys.readouterr().out


def test_prompt_only_uses_the_default_and_matches_an_explicit_model(shipped, capsys):
    out = gen(capsys, "def fibonacci(n):")
    assert out.strip() != ""
    assert gen(capsys, "--model", shipped, "def fibonacci(n):") == out
    assert gen(capsys, "-m", shipped, "--prompt", "def fibonacci(n):") == out
    assert gen(capsys, shipped, "--prompt", "def fibonacci(n):") == out            # the older form still works
    assert gen(capsys, "--prompt", "def fibonacci(n):") == out


def test_stdin_prompt_with_the_default(shipped, capsys, monkeypatch):
    want = gen(capsys, "def fibonacci(n):")
    monkeypatch.setattr("sys.stdin", io.StringIO("def fibonacci(n):"))
    assert gen(capsys) == want


def ns(text=None, model=None, prompt=None) -> argparse.Namespace:
    return argparse.Namespace(text=text, model=model, prompt=prompt)


def test_argument_resolution(shipped, tmp_path):
    assert generate_inputs(ns("hello")) == (shipped, "hello")
    assert generate_inputs(ns()) == (shipped, None)                                  # stdin
    assert generate_inputs(ns(str(tmp_path))) == (str(tmp_path), None)               # older form: DIR, stdin
    assert generate_inputs(ns("x/y", prompt="hi")) == ("x/y", "hi")                  # older form, path checked later
    assert generate_inputs(ns("hi", model="m")) == ("m", "hi")
    assert generate_inputs(ns(None, model="m", prompt="p")) == ("m", "p")
    with pytest.raises(ValueError, match="two prompts"):
        generate_inputs(ns("a", model="m", prompt="b"))
    args = build_parser().parse_args(["generate", "def f():"])
    assert (args.text, args.model, args.max_new_tokens) == ("def f():", None, 64)


def test_missing_default_says_how_to_pass_a_model(not_installed, capsys):
    assert main(["generate", "def fibonacci(n):"]) == 2
    err = capsys.readouterr().err
    assert "default model is not installed" in err and "--model DIR" in err and "config.json" in err
    with pytest.raises(default.DefaultModelMissing):
        default.default_model_dir()


def test_serve_without_a_model_uses_the_default(shipped):
    from kimi_linear.server.cli import build_server

    args = build_parser().parse_args(["serve", "--max-num-seqs", "2", "--memory", "64MiB"])
    assert args.model is None
    app, loop = build_server(args)
    try:
        assert args.model == shipped and args.served_model_name == default.NAME
    finally:
        loop.close()


def test_serve_without_a_model_or_default_fails_clearly(not_installed, capsys):
    assert main(["serve"]) == 2
    assert "default model is not installed" in capsys.readouterr().err
