"""The synthetic tasks label what they claim to, and are deterministic in their seed."""

import torch

from kimi_linear.train.data import TaskSource
from kimi_linear.train.schedule import lr_at
from kimi_linear.train.tasks import IGNORE, get_task


def test_mqar_answers_are_the_values_paired_with_the_keys():
    task = get_task("mqar", num_keys=20, num_values=30, num_noise=5, max_pairs=6)
    ids, labels = task.batch(8, 64, torch.Generator().manual_seed(0))
    assert ids.shape == labels.shape == (8, 64) and int(ids.max()) < task.vocab_size
    for b in range(8):
        pairs = dict(zip(ids[b, 0:12:2].tolist(), ids[b, 1:12:2].tolist()))
        scored = (labels[b] != IGNORE).nonzero().flatten().tolist()
        assert len(scored) == 6 and min(scored) >= 12                  # queries after the context ...
        assert sorted(ids[b, scored].tolist()) == sorted(pairs)          # ... each key asked exactly once
        for t in scored:
            assert labels[b, t] == pairs[int(ids[b, t])] == ids[b, t + 1]


def test_palindrome_scores_the_reversal():
    task = get_task("palindrome", alphabet=10)
    ids, labels = task.batch(4, 21, torch.Generator().manual_seed(1))
    assert torch.equal(ids[:, 11:21], ids[:, 0:10].flip(1)) and (ids[:, 10] == 10).all()
    assert torch.equal(labels[:, 10:20], ids[:, 11:21]) and (labels[:, :10] == IGNORE).all()


def test_stack_answers_follow_a_simulated_stack():
    task = get_task("stack", num_stacks=4, num_values=8)
    push, pop = 12, 13
    ids, labels = task.batch(3, 90, torch.Generator().manual_seed(2))
    pops = 0
    for b in range(3):
        stacks = {s: [] for s in range(4)}
        for i in range(30):
            op, s, x = ids[b, 3 * i:3 * i + 3].tolist()
            if op == push:
                stacks[s].append(x)
                assert labels[b, 3 * i + 1] == IGNORE
            else:
                assert op == pop and stacks[s].pop() == x == labels[b, 3 * i + 1]
                pops += 1
    assert pops > 10


def test_batches_are_deterministic_and_eval_is_held_out():
    src = TaskSource("mqar", batch_size=4, seq_len=64, seed=5)
    assert torch.equal(src.batch(3, 1)["input_ids"], TaskSource("mqar", 4, 64, seed=5).batch(3, 1)["input_ids"])
    assert not torch.equal(src.batch(3, 0)["input_ids"], src.batch(3, 1)["input_ids"])
    train_rows = {tuple(r) for s in range(20) for r in src.batch(s)["input_ids"].tolist()}
    assert all(tuple(r) not in train_rows for b in src.eval_batches() for r in b["input_ids"].tolist())


def test_schedules():
    kw = dict(peak=1.0, total=100, warmup=10, min_ratio=0.1)
    assert lr_at(0, **kw) == 0.1 and lr_at(9, **kw) == 1.0
    assert abs(lr_at(99, **kw, schedule="cosine") - 0.1) < 1e-3
    assert lr_at(55, **kw, schedule="cosine") < lr_at(30, **kw, schedule="cosine") < 1.0
    assert lr_at(79, **kw, schedule="wsd") == 1.0 and abs(lr_at(100, **kw, schedule="wsd") - 0.1) < 1e-9
    assert lr_at(90, **kw, schedule="wsd") < 1.0
    assert lr_at(50, **kw, schedule="constant") == 1.0
