"""`kimi-linear train --context-parallel 2` under torchrun (2 CPU processes, gloo): the first step's loss equals one
process on the same batch, and the run exports a loadable model; refused arguments name the problem."""

import json
import os
import subprocess
import sys

import pytest

from kimi_linear.cli import main
from kimi_linear.model import KimiLinearForCausalLM

COMMON = ["train", "--task", "mqar", "--steps", "1", "--batch-size", "2", "--seq-len", "64", "--hidden", "64",
          "--warmup", "1", "--device", "cpu"]


@pytest.mark.slow
def test_torchrun_context_parallel_step_equals_one_process(tmp_path, capsys):
    out = tmp_path / "cp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "kimi_linear.cli", *COMMON, "--context-parallel", "2", "--activation-checkpointing",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    cp = json.loads(done.stdout.strip().splitlines()[-1])
    assert main([*COMMON, "--out", str(tmp_path / "one")]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # MQAR's labels all sit in the second half of each row (rank 1's piece): the loss is normalised by the whole
    # batch's labels, not per piece. Held-out rows run whole on every rank after the (equal) update.
    assert abs(cp["loss"] - one["loss"]) <= 1e-5 * one["loss"], (cp, one)
    assert abs(cp["eval_loss"] - one["eval_loss"]) <= 1e-4 * one["eval_loss"], (cp, one)
    KimiLinearForCausalLM.from_pretrained(out / "step-1")


@pytest.mark.parametrize("argv, world, message", [
    ([*COMMON, "--context-parallel", "2"], "1", "needs torchrun with a multiple of 2 processes, got a world of 1"),
    ([*COMMON, "--context-parallel", "2", "--mixer", "gdn"], "2", "Gated DeltaNet layers have no context-parallel"),
    ([*COMMON, "--context-parallel", "2", "--seq-len", "63"], "2", "--seq-len 63 is not divisible by 2"),
    ([*COMMON, "--context-parallel", "2"], "6", "--batch-size 2 is not divisible by the 3 data-parallel replicas"),
    (["train", "--corpus", "stdlib", "--context-parallel", "2"], "2", "--corpus packs documents into rows"),
])
def test_context_parallel_refusals(tmp_path, capsys, monkeypatch, argv, world, message):
    """Checked before any process group is joined, identically on every rank."""
    monkeypatch.setenv("WORLD_SIZE", world)
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
