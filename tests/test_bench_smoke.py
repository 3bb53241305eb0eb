"""The GPU benchmark scripts of the decode path run end to end on the CPU with tiny shapes (``--smoke``: the
Triton interpreter for the kernels), so a device session never fails on a typo."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script,args", [
    ("engine_gpu.py", ["--smoke", "--no-hf", "--out", "{tmp}"]),
    ("fused_small_gpu.py", ["--smoke"]),
    ("mla_decode_gpu.py", ["--smoke"]),
    ("moe_gpu.py", ["--smoke"]),
    ("profile_decode.py", ["--smoke", "--batches", "1,2"]),
])
@pytest.mark.slow
def test_smoke(tmp_path, script, args):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *(a.format(tmp=tmp_path) for a in args)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "|" in done.stdout                                      # it printed its tables
