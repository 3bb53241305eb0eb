"""Router-bias load balancing: the quantile rule against its definition, and against the sign rule under stress."""

import torch

from kimi_linear.model import KimiLinearForCausalLM, preset_config
from kimi_linear.train.balancing import expert_load, quantile_update, router_stress_test
from kimi_linear.train.data import TaskSource
from kimi_linear.train.tasks import get_task
from kimi_linear.train.trainer import TrainConfig, Trainer


def test_quantile_target_gives_each_expert_its_share_alone():
    """Moving one expert's bias to the quantile target (others fixed) makes it win k/E of the tokens."""
    gen = torch.Generator().manual_seed(0)
    N, E, k = 4000, 8, 2
    scores = torch.rand(N, E, generator=gen) ** torch.linspace(0.3, 3, E)     # skewed preferences
    bias = 0.1 * torch.randn(E, generator=gen)
    target = quantile_update(bias, scores, k, damping=1.0)
    for e in range(E):
        moved = bias.clone()
        moved[e] = target[e]
        share = expert_load(scores, moved, k)[e] / N
        assert abs(share - k / E) < 0.01, (e, share)


def test_quantile_balances_better_and_faster_than_sign():
    sign = router_stress_test("sign", steps=100)
    quantile = router_stress_test("quantile", steps=100)
    assert quantile[-1] < 1.3 and quantile[-1] < sign[-1]
    assert quantile[9] < 1.5 < sign[9]                                            # within 10 updates


def test_trainer_updates_router_bias_and_logs_load():
    config = preset_config("tiny", vocab_size=576, hidden_size=64, intermediate_size=128, moe_intermediate_size=32)
    model = KimiLinearForCausalLM(config).init_weights(seed=0)
    source = TaskSource(get_task("mqar"), batch_size=4, seq_len=64)
    trainer = Trainer(model, source, TrainConfig(steps=3, warmup=1, progress=False, balance="quantile"))
    before = [r.e_score_correction_bias.clone() for r in trainer.routers.routers]
    history = trainer.fit()
    assert len(trainer.routers.routers) == 3                                      # layers 2-4 are MoE in `tiny`
    assert all(not torch.equal(b, r.e_score_correction_bias) for b, r in zip(before, trainer.routers.routers))
    assert all(len(h["expert_load_max_over_mean"]) == 3 and min(h["expert_load_max_over_mean"]) >= 1.0
               for h in history)


def test_evaluation_does_not_feed_the_router_bias_update():
    """Held-out forwards (eval mode) between steps are not recorded, so the next update sees one step's tokens."""
    from kimi_linear.train.trainer import evaluate

    config = preset_config("tiny", vocab_size=576, hidden_size=64, intermediate_size=128, moe_intermediate_size=32)
    model = KimiLinearForCausalLM(config).init_weights(seed=0)
    source = TaskSource(get_task("mqar"), batch_size=4, seq_len=64)
    trainer = Trainer(model, source, TrainConfig(steps=2, warmup=1, progress=False, balance="quantile"))
    trainer.train_step()
    assert all(not inputs for inputs in trainer.routers.inputs.values())          # consumed by the update
    evaluate(trainer.model, source, trainer.device)
    assert all(not inputs for inputs in trainer.routers.inputs.values())
    trainer.model.train()
    trainer.model(source.batch(0)["input_ids"])                                   # a training-mode forward counts
    assert all(len(inputs) == 1 for inputs in trainer.routers.inputs.values())
