"""`kimi-linear train` under torchrun (2 CPU processes, gloo, FSDP2), as a user would launch it."""

import json
import os
import subprocess
import sys

import pytest

from kimi_linear.model import KimiLinearForCausalLM


@pytest.mark.slow
def test_torchrun_two_ranks_trains_and_exports(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "kimi_linear.cli", "train", "--task", "mqar", "--steps", "2", "--batch-size", "4",
           "--seq-len", "64", "--hidden", "64", "--warmup", "1", "--device", "cpu", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])            # printed once, by rank 0
    assert last["step"] == 2
    ckpt = out / "step-2"
    assert (ckpt / "dcp").is_dir()
    model = KimiLinearForCausalLM.from_pretrained(ckpt)                 # the exported single-file model
    assert model.config.num_hidden_layers == 2
