"""bench/distributed.sh --smoke: the GPU benchmark's every phase (FSDP2 data parallel on 1 and 2 ranks for both
models, a checkpoint written by 2 ranks and loaded by 1, a context-parallel step, the one-device longest-sequence
search with its out-of-memory recovery, the report) on CPU with gloo, so the GPU calls cannot fail on a typo."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_distributed_bench_smoke(tmp_path):
    # Ranks start with this test's interpreter (the project may live in a virtual environment that is not on PATH).
    done = subprocess.run(["bash", str(ROOT / "bench" / "distributed.sh"), str(tmp_path), "--smoke"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    log = (tmp_path / "log.txt").read_text() if (tmp_path / "log.txt").exists() else ""
    assert done.returncode == 0, done.stderr[-2000:] + log[-3000:]
    assert log.count("=== exit 0") == 8 and "exit 1" not in log, log[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for tag in ("dp", "dp-48b-8l"):
        dp1, dp2 = summary["phases"][f"{tag}-w1"]["result"], summary["phases"][f"{tag}-w2"]["result"]
        assert dp1["tokens_per_step"] == dp2["tokens_per_step"] and dp1["tokens_per_s"] > 0 < dp2["tokens_per_s"]
        assert summary[f"{tag}_scaling"]["loss_max_rel_diff"] < 1e-5        # 2 ranks train what 1 does
    assert summary["phases"]["dp-48b-8l-w1"]["result"]["model"] == "48b-8l"
    load = summary["phases"]["ckpt-load-w1"]["result"]
    assert (load["written_by_ranks"], load["loaded_on_ranks"]) == (2, 1) and summary["checkpoint_same_tokens"]
    cp = summary["phases"]["cp-w2"]["result"]
    assert cp["ranks"] == 2 and cp["steps"] and cp["tokens_per_s"] > 0
    longest = summary["phases"]["longest-w1"]["result"]
    assert [r["seq_len"] for r in longest["runs"]] == [256, 128] and longest["runs"][0]["oom"]
    assert longest["longest_held"] == 128
    assert "| context parallel, one sequence | 2 | 256 |" in done.stdout


@pytest.mark.slow
def test_distributed_bench_one_gpu_phases(tmp_path):
    """``--one-gpu``: only the phases a one-GPU host can run (data parallel on one rank, a checkpoint written and
    loaded by one rank, the longest sequence one device holds), and the report of what they measured; --one-gpu
    itself never reaches the phases' arguments."""
    done = subprocess.run(["bash", str(ROOT / "bench" / "distributed.sh"), str(tmp_path), "--one-gpu", "--smoke"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    log = (tmp_path / "log.txt").read_text() if (tmp_path / "log.txt").exists() else ""
    assert done.returncode == 0, done.stderr[-2000:] + log[-3000:]
    assert log.count("=== exit 0") == 5 and "on 2 rank(s)" not in log, log[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["phases"]["dp-w2"] is None and summary["phases"]["cp-w2"] is None
    assert summary["phases"]["dp-w1"]["result"]["tokens_per_s"] > 0
    assert summary["phases"]["dp-48b-8l-w1"]["result"]["tokens_per_s"] > 0
    assert summary["checkpoint_same_tokens"]
    assert summary["one_gpu_longest_held"] == 128
    assert "| one GPU: longest held | 1 | 128 |" in done.stdout


def test_distributed_bench_groups(tmp_path):
    """``--groups`` runs the named phase groups only, and an unknown group is refused before anything starts."""
    bad = subprocess.run(["bash", str(ROOT / "bench" / "distributed.sh"), str(tmp_path), "--smoke", "--groups",
                          "dp,bogus"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown group 'bogus'" in bad.stderr and not (tmp_path / "log.txt").exists()
