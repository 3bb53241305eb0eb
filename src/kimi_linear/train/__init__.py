"""Training: the trainer, deterministic batch sources and the synthetic tasks of the Kimi Linear report."""

from .data import TaskSource
from .schedule import lr_at
from .tasks import MQAR, Palindrome, Stack, get_task
from .trainer import TrainConfig, Trainer, evaluate, lm_loss, resume

__all__ = ["MQAR", "Palindrome", "Stack", "TaskSource", "TrainConfig", "Trainer", "evaluate", "get_task", "lm_loss",
           "lr_at", "resume"]
