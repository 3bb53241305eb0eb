"""The GPU benchmark scripts of the decode path run end to end on the CPU with tiny shapes (``--smoke``: the
Triton interpreter for the kernels), so a device session never fails on a typo."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script,args", [
    ("engine_gpu.py", ["--smoke", "--no-hf", "--parts", "kabm", "--out", "{tmp}"]),
    ("engine_gpu.py", ["--smoke", "--no-hf", "--parts", "b", "--block-size", "64", "--out", "{tmp}"]),
    ("fused_small_gpu.py", ["--smoke"]),
    ("kda_kernels.py", ["--smoke", "--regimes", "--no-decode", "--no-fla", "--out", "{tmp}"]),
    ("mla_decode_gpu.py", ["--smoke"]),
    ("mla_decode_gpu.py", ["--smoke", "--no-check", "--block-size", "64"]),
    ("mla_decode_gpu.py", ["--smoke", "--no-bench", "--sweep", "--launches", "64,16,8,4", "--candidate", "64,16,8,4"]),
    ("moe_gpu.py", ["--smoke"]),
    ("moe_gpu.py", ["--smoke", "--no-tma"]),
    ("moe_gpu.py", ["--smoke", "--grid", "--N", "1"]),
    ("profile_decode.py", ["--smoke", "--batches", "1,2"]),
    ("profile_decode.py", ["--smoke", "--engine"]),
    ("profile_prefill.py", ["--smoke"]),
])
@pytest.mark.slow
def test_smoke(tmp_path, script, args):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *(a.format(tmp=tmp_path) for a in args)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "|" in done.stdout                                      # it printed its tables


def test_long_context_smoke(tmp_path):
    """bench/long_context.py --smoke: both models' decode points (random cache fill, batch 1 and the largest) and
    prefill points (a real chunked prefill decoded from there), the float32 checks, the merged tables and plot."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "long_context.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads((tmp_path / "long_context_smoke.json").read_text())
    for model in ("hybrid", "mla"):
        res = doc["models"][model]
        assert {(r["context"], r["batch"]) for r in res["decode"]} == {(64, 1), (64, 2), (256, 1), (256, 2)}
        assert [r["context"] for r in res["prefill"]] == [64, 256]
        for r in res["decode"] + res["prefill"]:
            # the engine's allocation per sequence is info's prediction, rounded up to whole blocks
            assert r["info_cache_bytes"] <= r["seq_cache_bytes"] <= r["info_cache_bytes"] * 1.3
    assert doc["check"]["engine_vs_forward"]["identical"] and doc["check"]["kda_state"]["ok"]
    assert (tmp_path / "long_context.png").stat().st_size > 10_000
    assert "all-MLA / hybrid" in (tmp_path / "long_context.md").read_text()


@pytest.mark.slow
def test_kda_ab_smoke(tmp_path):
    """bench/kda_ab.py: ``prepare`` exports src/ of a revision (no model assets), ``run --smoke --check`` profiles
    every tree for every gate regime and runs its checks; a tree whose kernels are broken is reported FAIL."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    ab = [sys.executable, str(ROOT / "bench" / "kda_ab.py")]
    subprocess.run([*ab, "prepare", "HEAD", "--into", str(tmp_path)], check=True, cwd=ROOT, env=env)
    assert not (tmp_path / "HEAD" / "src" / "kimi_linear" / "assets").exists()
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(tmp_path / "HEAD"), str(broken)], check=True)
    common = broken / "src" / "kimi_linear" / "ops" / "triton" / "chunk_common.py"
    text = common.read_text()
    assert "b_C = -tl.sum(" in text
    common.write_text(text.replace("b_C = -tl.sum(", "b_C = -0.5 * tl.sum("))   # the inverse's doubled blocks
    done = subprocess.run([*ab, "run", str(tmp_path), "--rounds", "1", "--smoke", "--check"], capture_output=True,
                          text=True, timeout=900, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("### ") == 6                       # five regimes and the checks
    assert "| HEAD |" in done.stdout and "| broken |" in done.stdout
    assert "- HEAD: PASS" in done.stdout and "- broken: FAIL" in done.stdout


def test_decode_ab_smoke(tmp_path):
    """bench/decode_ab.py: ``run --smoke --generate`` times every prepared tree's engine and generate steps in a
    process of its own; a tree whose package cannot run gives no rows, says why and makes the run fail."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    ab = [sys.executable, str(ROOT / "bench" / "decode_ab.py")]
    subprocess.run([*ab, "prepare", "HEAD", "--into", str(tmp_path)], check=True, cwd=ROOT, env=env)
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(tmp_path / "HEAD"), str(broken)], check=True)
    (broken / "src" / "kimi_linear" / "model" / "paged.py").write_text("raise ImportError('broken tree')\n")
    done = subprocess.run([*ab, "run", str(tmp_path), "--rounds", "1", "--smoke", "--generate"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 1 and "broken tree" in done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| HEAD |"))
    assert row.count("(") == 2                                   # engine and generate at the smoke context
    assert "| broken |  |  |" in done.stdout


def load_bench(name: str):
    """bench/NAME.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kda_kernels_regime_summary():
    """bench/kda_kernels.py states the regime grid against issue 20's goals: per pass the worst row, the median and
    how many rows meet the bar (1.3x forward, 1.2x forward + backward), and whether the median forward is 1.7x; a
    pass without rows (fla absent, or cut by the budget) says nothing."""
    kk = load_bench("kda_kernels")
    lines = kk.regime_summary({"fwd": [(1.4, "a"), (1.6, "b"), (1.8, "c"), (1.25, "d")],
                               "fwd+bwd": [(1.29, "a"), (1.19, "b"), (1.2, "c")]})
    assert lines == ["  fwd: worst 1.25x fla (d), median 1.50x; 3 of 4 rows >= 1.3x; median >= 1.7x: missed",
                     "  fwd+bwd: worst 1.19x fla (b), median 1.20x; 2 of 3 rows >= 1.2x"]   # a row at the bar meets it
    assert kk.regime_summary({"fwd": [(1.7, "a"), (1.9, "b"), (1.3, "c")], "fwd+bwd": []}) == [
        "  fwd: worst 1.30x fla (c), median 1.70x; 3 of 3 rows >= 1.3x; median >= 1.7x: met"]


def test_kda_ab_reads_forward_and_backward_profiles(monkeypatch):
    """bench/kda_ab.py's ``profile`` turns kda_kernels.py's regime-profile lines into per-regime kernel times:
    the forward under the regime's name, forward + backward under "<regime>, fwd+bwd"; other lines are ignored. A
    shape given is passed on."""
    kda_ab = load_bench("kda_ab")
    out = "\n".join([
        "  regime profile 16x2048 strong decay, ours fwd: 4.945 ms of kernels: chunk_kda_fwd_scores_kernel 2.721 ms"
        " x2; chunk_kda_fwd_wy_kernel 1.284 ms x1",
        "  regime profile 16x2048 strong decay, fla fwd: 3.700 ms of kernels: chunk_kda_fwd_kernel_intra 0.790 ms x1",
        "  regime profile 16x2048 strong decay, ours fwd+bwd: 20.100 ms of kernels: chunk_kda_bwd_intra_kernel"
        " 6.700 ms x2",
    ])
    seen = []

    def fake_run(tree, args, smoke):
        seen.append(args)
        return subprocess.CompletedProcess(args, 0, stdout=out)

    monkeypatch.setattr(kda_ab, "kda_kernels", fake_run)
    times = kda_ab.profile("tree", smoke=True, backward=True)
    assert "--no-backward" not in seen[0]
    assert times == {"16x2048 strong decay": {"total": 4.945, "chunk_kda_fwd_scores": 2.721,
                                              "chunk_kda_fwd_wy": 1.284},
                     "16x2048 strong decay, fwd+bwd": {"total": 20.1, "chunk_kda_bwd_intra": 6.7}}
    kda_ab.profile("tree", smoke=True, backward=False)
    assert "--no-backward" in seen[1] and "--shapes" not in seen[1]
    kda_ab.profile("tree", smoke=True, backward=False, shape="1x32768")   # --shape: kda_kernels.py's --shapes
    assert seen[2][seen[2].index("--shapes") + 1] == "1x32768"


def test_kda_ab_tree_with_a_launch_config(tmp_path, monkeypatch):
    """``prepare REV --name NAME --config JSON`` exports the revision as NAME with the config beside its src/, and
    every kda_kernels.py run on that tree gets ``--config JSON``; a tree without one runs the defaults; a config
    that is not JSON is refused before anything is exported."""
    kda_ab = load_bench("kda_ab")
    monkeypatch.chdir(ROOT)
    assert kda_ab.prepare(["HEAD"], str(tmp_path), name="capped", config='{"scores_regs": 168}') == 0
    assert (tmp_path / "capped" / "src" / "kimi_linear" / "ops").is_dir()
    with pytest.raises(ValueError):
        kda_ab.prepare(["HEAD"], str(tmp_path), name="bad", config="{scores_regs: 168}")
    assert not (tmp_path / "bad").exists()
    assert kda_ab.prepare(["HEAD", "HEAD~1"], str(tmp_path), name="two") == 2
    cmds = []
    monkeypatch.setattr(kda_ab.subprocess, "run", lambda cmd, **kw: cmds.append(cmd))
    kda_ab.kda_kernels(str(tmp_path / "capped"), ["--check"], False)
    (tmp_path / "plain" / "src").mkdir(parents=True)
    kda_ab.kda_kernels(str(tmp_path / "plain"), ["--check"], False)
    assert cmds[0][-3:] == ["--check", "--config", '{"scores_regs": 168}']
    assert "--config" not in cmds[1]


def test_kda_ab_saves_each_profile_and_tables_merge_calls(tmp_path, monkeypatch, capsys):
    """``run --save FILE`` rewrites FILE after every profile (a call cut short keeps what it measured), and
    ``table`` over several saved files shows each tree's median over all of their rounds."""
    kda_ab = load_bench("kda_ab")
    for t in ("A", "B"):
        (tmp_path / "trees" / t / "src").mkdir(parents=True)
    times = iter([1.0, 2.0, 3.0, 4.0])
    saved = []

    def fake_profile(tree, smoke, backward, shape=""):
        if saved:                                 # the previous profile is already on disk
            with open(tmp_path / "one.json") as f:
                saved.append(sum(len(rs) for rs in json.load(f).values()))
        else:
            saved.append(0)
        return {"mild": {"total": next(times), "chunk_kda_fwd_wy": 0.5}}

    monkeypatch.setattr(kda_ab, "profile", fake_profile)
    assert kda_ab.run(str(tmp_path / "trees"), 2, False, True, save=str(tmp_path / "one.json")) == 0
    assert saved == [0, 1, 2, 3]
    with open(tmp_path / "two.json", "w") as f:
        json.dump({"A": [{"mild": {"total": 11.0}}]}, f)
    capsys.readouterr()
    kda_ab.table(kda_ab.merged([str(tmp_path / "one.json"), str(tmp_path / "two.json")]))
    out = capsys.readouterr().out
    assert "### mild (ms, median of 3" in out
    assert "| A | 3.000 (10.000) | 0.500 (0.000) |" in out      # A: 1, 3, 11
    assert "| B | 3.000 (2.000) | 0.500 (0.000) |" in out       # B: 2, 4


def run_kda_grid(tmp_path, *args, python=None, repo=ROOT):
    """``repo``'s bench/kda_grid.sh OUT ARGS, with ``python`` (a script) as its interpreter when given."""
    env = {**os.environ, **({"PYTHON": str(python)} if python else {})}
    return subprocess.run(["bash", str(repo / "bench" / "kda_grid.sh"), str(tmp_path / "out"), *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def fake_python(tmp_path, fla_importable=True):
    """A stand-in interpreter that prints the arguments it is run with (``import fla`` fails unless
    ``fla_importable``)."""
    fake = tmp_path / "fake_python"
    fake.write_text("#!/bin/sh\n" + ("" if fla_importable else 'case "$*" in *"import fla"*) exit 1;; esac\n')
                    + 'echo "ran: $*"\n')
    fake.chmod(0o755)
    return fake


def test_kda_grid_arguments(tmp_path):
    """bench/kda_grid.sh, the device call of issue 20: with --card it runs nothing on another card (here: none);
    an unknown argument is refused by name; after --, arguments reach kda_kernels.py's grid, and each asked step
    runs with its own command (a fake interpreter records them)."""
    skipped = run_kda_grid(tmp_path, "--card", "H200")
    assert skipped.returncode == 0 and "not a H200: nothing run" in skipped.stdout
    bad = run_kda_grid(tmp_path, "--bogus")
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr
    done = run_kda_grid(tmp_path, "--check", "--fla-tests", "--", "--shapes", "16x2048", python=fake_python(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    logs = {n: (tmp_path / "out" / f"{n}.log").read_text() for n in ("grid", "check", "fla_tests")}
    assert "bench/kda_kernels.py --regimes --no-decode --budget 360" in logs["grid"]
    assert logs["grid"].rstrip().endswith("--shapes 16x2048")
    assert "--check --only check" in logs["check"] and "bench/fla_tests.py --jobs 8" in logs["fla_tests"]
    assert "== grid: exit 0" in done.stdout and "== fla_tests: exit 0" in done.stdout
    ab = run_kda_grid(tmp_path, "--no-grid", "--ab", ".gl/x", "--backward", "--ab-shape", "1x32768",
                      python=fake_python(tmp_path))
    assert ab.returncode == 0, ab.stdout + ab.stderr
    ab_log = (tmp_path / "out" / "ab.log").read_text()
    assert "bench/kda_ab.py run .gl/x --rounds 2 --backward --shape 1x32768 --save" in ab_log
    assert "--ab-shape takes a shape" in run_kda_grid(tmp_path, "--ab", ".gl/x", "--ab-shape").stderr


def test_kda_grid_installs_fla_from_one_wheel_folder(tmp_path):
    """Without fla importable, bench/kda_grid.sh installs the wheels of one folder (.fla/wheels when it has any,
    else .whl: pip refuses the same wheel twice), every wheel of it."""
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    (repo / "bench" / "kda_grid.sh").write_text((ROOT / "bench" / "kda_grid.sh").read_text())
    (repo / ".whl").mkdir()
    for name in ("einops.whl", "fla_core.whl"):
        (repo / ".whl" / name).touch()
    fake = fake_python(tmp_path, fla_importable=False)

    def install_line():
        done = run_kda_grid(tmp_path, "--no-grid", python=fake, repo=repo)
        assert done.returncode == 0, done.stderr
        return next(line for line in done.stdout.splitlines() if "pip install" in line)

    assert install_line().endswith(".whl/einops.whl .whl/fla_core.whl")
    (repo / ".fla" / "wheels").mkdir(parents=True)
    (repo / ".fla" / "wheels" / "fla_core.whl").touch()
    assert install_line().endswith("--target /tmp/site .fla/wheels/fla_core.whl")
