"""`kimi-linear train` end to end: a synthetic task, and packed stdlib text that `generate` can then load."""

import json

from kimi_linear.cli import main


def test_train_task_writes_a_loadable_checkpoint(tmp_path, capsys):
    out = tmp_path / "mqar"
    rc = main(["train", "--task", "mqar", "--steps", "3", "--batch-size", "2", "--seq-len", "64", "--hidden", "64",
               "--warmup", "1", "--out", str(out), "--device", "cpu"])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["step"] == 3 and "eval_accuracy" in last
    assert (out / "step-3" / "config.json").is_file() and (out / "step-3" / "trainer_state.pt").is_file()
    # The checkpoint carries a tokenizer (token i written as the number i) and no EOS (id 0 is a key): generate
    # loads it as it is and writes exactly the tokens asked for.
    assert (out / "step-3" / "tokenizer.json").is_file()
    assert main(["generate", str(out / "step-3"), "--prompt", "3 260 5 270 3", "-n", "4", "--no-stream"]) == 0
    words = capsys.readouterr().out.split()
    assert len(words) == 4 and all(0 <= int(w) < 576 for w in words)


def test_train_on_stdlib_text_then_generate_and_resume(tmp_path, capsys):
    out = tmp_path / "py"
    common = ["--corpus", "stdlib", "--max-files", "8", "--vocab-size", "400", "--preset", "tiny", "--seq-len", "128",
              "--batch-size", "2", "--warmup", "1", "--out", str(out), "--device", "cpu"]
    assert main(["train", *common, "--steps", "2"]) == 0
    ckpt = out / "step-2"
    assert (ckpt / "tokenizer.json").is_file()
    assert main(["train", *common, "--steps", "3", "--resume", str(ckpt)]) == 0
    capsys.readouterr()
    assert main(["generate", str(out / "step-3"), "--prompt", "def f(x):", "--max-new-tokens", "4",
                 "--no-stream"]) == 0
    assert capsys.readouterr().out.strip() != ""


def test_train_needs_exactly_one_data_source(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path)]) == 2
    assert "exactly one of --task or --corpus" in capsys.readouterr().err
