"""The synthetic-task grid (bench/synthetic.py) and what it rests on: time-budgeted training
(kimi_linear.train.budget) and document-piece batches (kimi_linear.train.chunks)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kimi_linear.model import KimiLinearForCausalLM, preset_config
from kimi_linear.train.budget import Clock, annealed_lr, fit_within
from kimi_linear.train.chunks import DocumentChunkSource, cut_pieces
from kimi_linear.train.data import TaskSource
from kimi_linear.train.models import task_model_config
from kimi_linear.train.schedule import lr_at
from kimi_linear.train.tasks import IGNORE, get_task
from kimi_linear.train.trainer import TrainConfig, Trainer

ROOT = Path(__file__).resolve().parents[2]
TASK = get_task("mqar", num_keys=16, num_values=16, num_noise=4, max_pairs=2)


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tiny_trainer(steps: int, schedule: str = "cosine") -> Trainer:
    cfg = task_model_config("kda", TASK.vocab_size, hidden_size=32, num_heads=1, head_dim=16)
    model = KimiLinearForCausalLM(cfg).init_weights(seed=0)
    source = TaskSource(TASK, batch_size=4, seq_len=16, seed=0, eval_batches=1)
    return Trainer(model, source, TrainConfig(steps=steps, lr=3e-3, warmup=2, schedule=schedule, progress=False))


# --------------------------------------------------------------------------------------------------------- budget
def test_without_a_time_limit_fit_within_is_fit():
    a, b = tiny_trainer(6), tiny_trainer(6)
    a.config.eval_every = 3
    want = a.fit()
    got = fit_within(b, None, eval_every=3)
    assert got.stopped_by == "steps" and got.steps == 6 and got.tokens == 6 * 4 * 16
    assert [r["loss"] for r in got.history] == [r["loss"] for r in want]
    assert [r["lr"] for r in got.history] == [r["lr"] for r in want]
    assert [r["step"] for r in got.evals] == [3, 6]
    assert [r["eval_loss"] for r in got.evals] == [r["eval_loss"] for r in want if "eval_loss" in r]
    assert "lr" not in b.__dict__                                         # the class schedule is back


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_a_run_cut_by_time_stops_gracefully_with_its_schedule_annealed(schedule):
    trainer = tiny_trainer(10**6, schedule)
    trainer.config.warmup = 1
    calls = []
    got = fit_within(trainer, 1.5, eval_every=10**5, on_eval=lambda rec, clock: calls.append(rec["step"]))
    assert got.stopped_by == "time" and 2 <= got.steps < 10**6
    assert got.seconds >= 1.5 and calls == [got.steps]                  # evaluated once, at the last step
    assert "eval_accuracy" in got.history[-1]
    lrs = [r["lr"] for r in got.history]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))                    # past warmup: only ever down


class FakeClock:
    def __init__(self, fraction: float) -> None:
        self.value = fraction

    def fraction(self) -> float:
        return self.value


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_the_schedule_follows_whichever_clock_is_further(schedule):
    trainer = tiny_trainer(1000, schedule)
    c = trainer.config
    at = lambda step: lr_at(step, peak=c.lr, total=c.steps, warmup=c.warmup, schedule=schedule,  # noqa: E731
                            min_ratio=c.min_lr_ratio, decay_fraction=c.decay_fraction)
    assert annealed_lr(trainer, FakeClock(0.0))(500) == at(500)         # no time spent: the step schedule
    assert annealed_lr(trainer, FakeClock(0.9))(10) == at(900)          # 90% of the time gone, step 10
    assert annealed_lr(trainer, FakeClock(0.2))(900) == at(900)         # steps ahead of time
    assert annealed_lr(trainer, FakeClock(5.0))(10) == at(1000) == pytest.approx(c.lr * c.min_lr_ratio)  # floor
    assert annealed_lr(trainer, FakeClock(0.9))(1) == at(1)             # warmup goes by step


def test_budget_arguments_are_checked():
    with pytest.raises(ValueError, match="`seconds`"):
        Clock(0)
    with pytest.raises(ValueError, match="`eval_every`"):
        fit_within(tiny_trainer(1), None, eval_every=-1)


# --------------------------------------------------------------------------------------------------------- chunks
def test_document_pieces_score_every_token_once_and_pad_on_the_right():
    docs = [torch.arange(10, 10 + n) for n in (1, 7, 8, 20)]
    src = DocumentChunkSource(docs, docs[:2], batch_size=3, seq_len=8, pad_id=0, seed=1)
    assert cut_pieces(docs, 8) == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 8), (3, 16)]
    n = len(src.train_pieces)
    scored, real = [], 0
    for step in range(n // 3):
        b = src.batch(step)
        ids, labels = b["input_ids"], b["labels"]
        assert ids.shape == labels.shape == (3, 8)
        for row_ids, row_labels in zip(ids.tolist(), labels.tolist()):
            k = sum(1 for t in row_ids if t != 0)
            assert all(t == 0 for t in row_ids[k:]) and all(t == IGNORE for t in row_labels[k:])
            assert row_ids[1:k] == row_labels[:k - 1]                    # next token inside the piece
            scored += [t for t in row_labels if t != IGNORE]
            real += k
    assert sorted(scored) == sorted(t for d in docs for t in d[1:].tolist())  # all but each document's first token
    assert src.served_tokens == real == sum(len(d) for d in docs)
    assert src.batch(5)["input_ids"].tolist() == src.batch(5)["input_ids"].tolist()      # pure function of step
    assert [b["input_ids"].shape[0] for b in src.eval_batches()] == [2]
    with pytest.raises(ValueError, match="`batch_size`"):
        DocumentChunkSource(docs, docs, batch_size=0, seq_len=8, pad_id=0)


def test_right_padding_does_not_change_a_pieces_logits():
    """The premise of padded pieces: a causal hybrid model (KDA, MLA, conv, MoE) ignores what follows."""
    config = preset_config("tiny", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4)
    model = KimiLinearForCausalLM(config).init_weights(seed=2).eval()
    piece = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(0))
    padded = torch.cat([piece, torch.full((1, 60), 258)], 1)
    with torch.no_grad():
        assert torch.allclose(model(padded).logits[:, :70], model(piece).logits, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------------------ synthetic
def test_cell_time_shares_are_fair_and_use_the_whole_budget():
    syn = load_bench("synthetic")
    import time

    deadline = time.time() + 100.0
    first = [syn.cell_seconds(deadline, i, 7, 3) for i in range(3)]       # first wave: 3 rounds for 7 cells
    assert all(abs(s - 100 / 3) < 1 for s in first)
    assert abs(syn.cell_seconds(deadline, 3, 7, 3) - 100 / 2) < 1       # 4 cells + 2 running elsewhere: 2 rounds
    assert abs(syn.cell_seconds(deadline, 6, 7, 3) - 100) < 1           # the last round gets what is left
    assert abs(syn.cell_seconds(deadline, 0, 1, 4) - 100) < 1
    assert syn.cell_seconds(None, 0, 7, 3) is None


def test_report_reads_finished_and_partial_cells(tmp_path):
    syn = load_bench("synthetic")
    out = str(tmp_path / "r.jsonl")
    base = {"task": "mqar", "seq_len": 256, "batch": 16, "steps_planned": 100, "device_name": "cpu", "partial": False}
    syn.append_result(out, {**base, "mixer": "kda", "steps": 100, "stopped_by": "steps", "final_accuracy": 0.9,
                            "curve": [[50, 0.4], [100, 0.9]]})
    syn.write_partial(out, "mqar-gdn-256", {**base, "mixer": "gdn", "steps": 60, "stopped_by": "running",
                                            "partial": True, "final_accuracy": 0.5, "curve": [[50, 0.5]]})
    with open(out, "a") as f:
        f.write('{"task": "mqar", "mixer": "att')                        # a torn line is skipped
    runs = syn.load_results(out)
    assert {r["mixer"] for r in runs} == {"kda", "gdn"}
    table = syn.report_table(runs)
    assert "0.900 @100 |" in table and "0.500 @60 (killed)" in table
    assert "| mqar | 256 | 50 | 0.400 | 0.500 | **no** | 100 | >60 |" in table   # KDA vs GDN at a common step


def test_grid_runs_in_parallel_workers_and_reports(tmp_path):
    out = tmp_path / "syn.jsonl"
    png = tmp_path / "syn.png"
    cmd = [sys.executable, str(ROOT / "bench" / "synthetic.py"), "--quick", "--tasks", "mqar,palindrome",
           "--mixers", "kda,attention", "--steps", "4", "--eval-every", "2", "--jobs", "2", "--time-budget", "300",
           "--out", str(out), "--png", str(png)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted((r["task"], r["mixer"]) for r in lines) == sorted(
        (t, m) for t in ("mqar", "palindrome") for m in ("kda", "attention"))
    for r in lines:
        assert r["steps"] == 4 and r["stopped_by"] == "steps" and [s for s, _ in r["curve"]] == [2, 4]
    assert png.stat().st_size > 0 and not (tmp_path / "syn.jsonl.partial").exists()
    assert "| mqar | kda | " in run.stdout


def test_lr_and_batch_given_on_the_command_line_win_over_the_task_defaults():
    syn = load_bench("synthetic")
    left_out = syn.parse_args([])
    assert left_out.explicit == set() and (left_out.lr, left_out.batch) == (1e-3, 16)
    # the base defaults typed out are still the user's choice, also for MQAR (before: silently replaced)
    typed = syn.parse_args(["--lr", "1e-3", "--batch", "16"])
    assert typed.explicit == {"lr", "batch"} and (typed.lr, typed.batch) == (1e-3, 16)
    quick = syn.parse_args(["--quick"])
    assert quick.batch == 4 and "batch" in quick.explicit


def test_fit_within_evaluates_at_the_trainers_own_interval_by_default():
    from kimi_linear.train.budget import fit_within

    trainer = tiny_trainer(7)
    trainer.config.eval_every = 3
    got = fit_within(trainer, None)
    assert [r["step"] for r in got.evals] == [3, 6, 7]
