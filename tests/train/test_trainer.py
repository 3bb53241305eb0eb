"""Training on the CPU: MQAR is learned, and a resumed run repeats the uninterrupted one exactly."""

import os

import pytest

from kimi_linear.model import KimiLinearForCausalLM
from kimi_linear.train.data import TaskSource
from kimi_linear.train.models import task_model_config
from kimi_linear.train.tasks import get_task
from kimi_linear.train.trainer import TrainConfig, Trainer, resume

TASK = get_task("mqar", num_keys=32, num_values=32, num_noise=8, max_pairs=4)


def make_run(tmp_path, steps=200):
    cfg = task_model_config("kda", TASK.vocab_size, hidden_size=64, num_heads=2, head_dim=32)
    model = KimiLinearForCausalLM(cfg).init_weights(seed=0)
    source = TaskSource(TASK, batch_size=32, seq_len=32, seed=0)
    config = TrainConfig(steps=steps, lr=3e-3, warmup=20, progress=False, save_every=100,
                         out_dir=os.fspath(tmp_path))
    return Trainer(model, source, config), source, config


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mqar")
    trainer, source, config = make_run(tmp)
    history = trainer.fit()
    return tmp, history, source, config


def test_mqar_loss_falls_and_accuracy_beats_chance(full_run):
    _, history, _, _ = full_run
    first, last = history[0], history[-1]
    assert len(history) == 200
    assert last["loss"] < 0.75 * first["loss"], (first["loss"], last["loss"])
    assert last["eval_accuracy"] > 4 * TASK.chance, last["eval_accuracy"]


def test_resume_from_mid_run_checkpoint_repeats_the_losses_exactly(full_run):
    tmp, history, source, config = full_run
    ckpt = tmp / "step-100"
    assert (ckpt / "config.json").is_file() and (ckpt / "trainer_state.pt").is_file()
    assert not [p for p in os.listdir(tmp) if ".tmp-" in p or ".old-" in p]
    config = TrainConfig(**{**config.to_json(), "out_dir": None})
    trainer = resume(ckpt, source, config)
    assert trainer.step == 100
    resumed = trainer.fit()
    assert [r["loss"] for r in resumed[100:]] == [r["loss"] for r in history[100:]]
    assert [r["grad_norm"] for r in resumed[100:]] == [r["grad_norm"] for r in history[100:]]


def test_resume_from_a_non_checkpoint_names_the_file(tmp_path):
    trainer, _, _ = make_run(tmp_path, steps=1)
    trainer.model.save_pretrained(tmp_path / "weights-only")
    with pytest.raises(FileNotFoundError, match="trainer_state.pt"):
        trainer.load_state(tmp_path / "weights-only")
