"""lm-evaluation-harness against kimi-linear, both ways, on two small local tasks (tests/eval/tasks: multiple choice
and generate-until): in-process (the `kimi_linear` model class on the engine) and through `kimi-linear serve` with
lm-eval's own `local-completions` backend at --batch_size 4. Both finish and give the same scores, document by
document (the same batches reach the same engine code: exact equality, floats included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install -e '.[eval]'")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from kimi_linear.eval import KimiLinearLM  # noqa: E402
from kimi_linear.model import KimiLinearForCausalLM, default  # noqa: E402
from tests.server.conftest import start_server, stop_server  # noqa: E402

TASKS_DIR = str(Path(__file__).resolve().parent / "tasks")
TASKS = ["kimi_linear_toy_mc", "kimi_linear_toy_gen"]
REPO = Path(__file__).resolve().parents[2]
shipped = pytest.mark.skipif(not default.ASSET_DIR.is_dir() or not any(default.ASSET_DIR.iterdir()),
                             reason="no shipped default model")


def evaluate(model, model_args=None) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=4,
                                   task_manager=local_tasks(), log_samples=True)


def local_tasks() -> TaskManager:
    return TaskManager(include_path=TASKS_DIR, include_defaults=False)      # not lm-eval's thousands


def per_doc(results: dict) -> dict[str, list]:
    """Each task's documents' raw answers (log-likelihoods and greedy flags, or generated text), by doc id."""
    return {t: [json.loads(json.dumps(s["resps"])) for s in sorted(results["samples"][t], key=lambda s: s["doc_id"])]
            for t in TASKS}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Every side computes with one thread: the server and this process then round alike (torch's CPU kernels may
    round differently with another thread count), and on a busy machine one thread is much faster than two
    fighting for a core."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
@shipped
def test_server_and_in_process_give_the_same_scores():
    path = str(default.ASSET_DIR)
    local = evaluate(KimiLinearLM(pretrained=path, batch_size=4))
    server = start_server(path, "--threads", "1")
    try:
        remote = evaluate("local-completions", {
            "model": path, "base_url": server.url + "/v1/completions", "tokenizer_backend": "huggingface",
            "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1, "timeout": 300})
    finally:
        stop_server(server)
    for t in TASKS:
        assert local["results"][t] == remote["results"][t], t
    assert per_doc(local) == per_doc(remote)
    r = local["results"]
    assert set(r[TASKS[0]]) >= {"acc,none", "acc_norm,none"} and "exact_match,none" in r[TASKS[1]]
    assert len(per_doc(local)[TASKS[0]]) == len(per_doc(local)[TASKS[1]]) == 8


def test_registered_and_not_imported_by_the_package(checkpoint):
    assert get_model("kimi_linear") is KimiLinearLM
    r = lm_eval.simple_evaluate(model="kimi_linear", model_args=f"pretrained={checkpoint}", tasks=[TASKS[0]],
                                limit=2, device="cpu", task_manager=local_tasks())
    assert 0 <= r["results"][TASKS[0]]["acc,none"] <= 1
    code = "import sys, kimi_linear, kimi_linear.model, kimi_linear.engine, kimi_linear.cli; " \
           "assert 'lm_eval' not in sys.modules, 'imported'"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.fixture(scope="module")
def tiny(checkpoint) -> KimiLinearLM:
    return KimiLinearLM(pretrained=checkpoint, batch_size=3, device="cpu")


def forward_logprobs(model: KimiLinearForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_loglikelihood_equals_a_plain_forward(tiny):
    pairs = [("def f(x):", " return x"), ("", "hello"), ("a b ", "c"), ("import", " os")]
    got = tiny.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    bos = tiny.tokenizer.bos_token_id
    for (ctx, cont), (lp, greedy) in zip(pairs, got):
        if ctx:
            ctx, cont = ctx.rstrip(), ctx[len(ctx.rstrip()):] + cont    # lm-eval moves trailing spaces
        c = tiny.tok_encode(ctx) if ctx else [bos]
        whole = tiny.tok_encode(ctx + cont) if ctx else [bos] + tiny.tok_encode(cont)
        ref = forward_logprobs(tiny.model, whole)
        want = [float(ref[t - 1, whole[t]]) for t in range(len(c), len(whole))]
        assert abs(lp - sum(want)) < 1e-4
        assert greedy == all(int(ref[t - 1].argmax()) == whole[t] for t in range(len(c), len(whole)))


@pytest.mark.parametrize("max_length", [None, 9])
def test_rolling_loglikelihood(checkpoint, max_length):
    lm = KimiLinearLM(pretrained=checkpoint, batch_size="auto", device="cpu", max_length=max_length)
    texts = ["The quick brown fox jumps over the lazy dog.", "x", ""]
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)],
                                   disable_tqdm=True)
    for text, total in zip(texts, got):
        want = 0.0
        for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(
                lm.tok_encode(text), lm.prefix_token_id, lm.max_length - 1, 1)):
            ids = ctx + pred
            assert len(ids) <= lm.max_length
            ref = forward_logprobs(lm.model, ids)
            want += sum(float(ref[t - 1, ids[t]]) for t in range(len(ctx), len(ids)))
        assert abs(total - want) < 1e-4, text
    assert got[2] == 0.0


def test_generation_kwargs_and_arguments_are_checked(tiny, checkpoint):
    req = Instance("generate_until", {}, ("x", {"until": ["\n"], "num_beams": 4}), 0)
    with pytest.raises(ValueError, match="`num_beams` not supported"):
        tiny.generate_until([req])
    for bad in ({"batch_size": 0}, {"max_length": "many"}, {"max_gen_toks": -1}, {"max_length": 10**6}):
        with pytest.raises(ValueError, match=f"`{next(iter(bad))}`"):
            KimiLinearLM(pretrained=checkpoint, device="cpu", **bad)


def test_generate_until_stops_at_until(tiny):
    reqs = [Instance("generate_until", {}, (p, {"until": ["e"], "max_gen_toks": 6}), i)
            for i, p in enumerate(["abc", "hello world", "zz"])]
    for text in tiny.generate_until(reqs, disable_tqdm=True):
        assert "e" not in text


def test_python_m_kimi_linear_eval(checkpoint):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    ok = subprocess.run([sys.executable, "-m", "kimi_linear.eval", "--model", checkpoint, "--tasks",
                         "kimi_linear_toy_mc", "--include_path", TASKS_DIR, "--limit", "2", "--batch_size", "4"],
                        capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "kimi_linear_toy_mc" in ok.stdout and "acc" in ok.stdout


def test_command_line_errors_and_lm_evals_own_command_line(checkpoint, capsys, monkeypatch):
    from kimi_linear.eval.cli import main

    assert main(["--model", checkpoint, "--tasks", "no_such_task", "--include_path", TASKS_DIR]) == 2
    assert capsys.readouterr().err.strip().startswith("error: `--tasks`: unknown task 'no_such_task'")
    # `lm_eval ...` hands the rest to lm-eval's own command line (here its help: a run would index every task).
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    with pytest.raises(SystemExit) as e:
        main(["lm_eval", "run", "--help"])
    assert e.value.code == 0 and "--model_args" in capsys.readouterr().out


def test_the_shipped_benchmark_task():
    """kimi_linear_stdlib_next_line (bench/eval_task.py) loads in lm-eval: 400 documents from held-out files, four
    distinct choices of the true line's indentation."""
    import zlib

    from lm_eval.tasks import get_task_dict

    from kimi_linear.eval.cli import OWN_TASKS

    task = get_task_dict(["kimi_linear_stdlib_next_line"], TaskManager(include_path=OWN_TASKS, include_defaults=False)
                         )["kimi_linear_stdlib_next_line"]
    docs = list(task.test_docs())
    assert len(docs) == 400
    for d in docs:
        assert zlib.crc32(Path(d["file"]).name.encode()) % 20 == 0          # the training split's held-out names
        ch = d["choices"]
        true = ch[d["label"]]
        assert len(set(ch)) == 4 and len(true.strip()) >= 12
        assert {c[: len(c) - len(c.lstrip())] for c in ch} == {true[: len(true) - len(true.lstrip())]}
        assert d["context"].count("\n") == 8
