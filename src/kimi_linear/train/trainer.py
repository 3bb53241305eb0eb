"""A causal-LM trainer for any model of this package: AdamW, warmup + cosine/WSD, clipping, accumulation,
bf16 autocast on GPU, evaluation, checkpoints in the Hugging Face format (docs/checkpoint.md), and exact resume.

Exact resume rests on three choices: batches are a pure function of ``(seed, step, micro-step)`` (see
:class:`BatchSource`), the learning rate is a pure function of the step, and a checkpoint holds the float32 weights,
the optimizer state and the step. Nothing else carries state between steps.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from .schedule import lr_at
from .tasks import IGNORE

STATE_FILE = "trainer_state.pt"


class BatchSource(Protocol):
    """Where batches come from: ``batch(step, micro)`` is deterministic; ``eval_batches()`` is a fixed held-out
    set. A batch is a dict with ``input_ids`` and ``labels`` [B, T] and optionally ``cu_seqlens``."""

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]: ...

    def eval_batches(self) -> Iterator[dict[str, torch.Tensor]]: ...


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping. ``steps`` counts optimizer steps; each takes ``grad_accum`` micro-batches."""

    steps: int = 1000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    schedule: str = "cosine"
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    grad_accum: int = 1
    eval_every: int = 0                  # 0: only at the end
    save_every: int = 0                  # 0: only at the end (when out_dir is set)
    out_dir: str | None = None
    bf16: bool = True                    # autocast on CUDA; ignored on CPU
    balance: str | None = None           # MoE router bias update: None, "sign" or "quantile" (see balancing.py)
    balance_rate: float = 1e-3           # step of the sign rule
    balance_damping: float = 0.5         # blend of the quantile rule
    progress: bool = True
    history: list[dict] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("history")
        return d


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions with a label (labels are already aligned with logits)."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE)


def forward_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    kwargs = {"cu_seqlens": batch["cu_seqlens"]} if batch.get("cu_seqlens") is not None else {}
    out = model(batch["input_ids"], **kwargs)
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def evaluate(model: torch.nn.Module, source: BatchSource, device: torch.device) -> dict[str, float]:
    """Held-out loss and accuracy (argmax equals the label, over labelled positions)."""
    was_training = model.training
    model.eval()
    total_loss, total_correct, total = 0.0, 0, 0
    for batch in source.eval_batches():
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = forward_logits(model, batch)
        labels = batch["labels"]
        n = int((labels != IGNORE).sum())
        total_loss += lm_loss(logits, labels).item() * n
        total_correct += int(((logits.argmax(-1) == labels) & (labels != IGNORE)).sum())
        total += n
    model.train(was_training)
    return {"loss": total_loss / max(1, total), "accuracy": total_correct / max(1, total)}


class RouterWatch:
    """Collects each MoE router's scores during a step (forward hooks) and applies a bias update rule after it.

    A router is any module with ``weight`` [E, D], ``top_k`` and an ``e_score_correction_bias`` buffer.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias") and hasattr(m, "top_k")]
        self.inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(self.routers))}
        for i, router in enumerate(self.routers):
            router.register_forward_hook(lambda mod, args, out, i=i: self._record(mod, i, args[0]))

    def _record(self, router: torch.nn.Module, i: int, x: torch.Tensor) -> None:
        # Only training forwards feed the bias update: held-out evaluation (eval mode) between steps must neither
        # steer the bias towards the held-out tokens nor pile up inputs until the next step.
        if router.training:
            self.inputs[i].append(x.detach())

    @torch.no_grad()
    def update(self, rule: str, **kw) -> list[float]:
        """Update every router's bias from this step's tokens; return each router's max/mean expert load."""
        from .balancing import expert_load, imbalance, update_bias

        loads = []
        for i, router in enumerate(self.routers):
            if not self.inputs[i]:
                continue
            x = torch.cat([t.reshape(-1, t.shape[-1]) for t in self.inputs[i]])
            scores = torch.sigmoid(x.float() @ router.weight.float().t())
            bias = router.e_score_correction_bias
            loads.append(imbalance(expert_load(scores, bias.float(), router.top_k)))
            bias.copy_(update_bias(rule, bias.float(), scores, router.top_k, **kw))
            self.inputs[i].clear()
        return loads


class Trainer:
    """Train ``model`` on ``source`` under ``config``. ``step`` is the number of optimizer steps taken."""

    def __init__(self, model: torch.nn.Module, source: BatchSource, config: TrainConfig) -> None:
        self.model, self.source, self.config = model, source, config
        self.device = next(model.parameters()).device
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr, betas=config.betas,
        )
        self.step = 0
        self.history: list[dict] = []
        self.tokenizer = None            # saved beside each checkpoint when set (the train CLI always sets one)
        self.sharded = False             # FSDP2 across ranks: checkpoints go through DCP (see distributed.py)
        self.routers = RouterWatch(model) if config.balance else None

    # --------------------------------------------------------------------------------------------- one step
    def lr(self, step: int) -> float:
        c = self.config
        return lr_at(step, peak=c.lr, total=c.steps, warmup=c.warmup, schedule=c.schedule,
                     min_ratio=c.min_lr_ratio, decay_fraction=c.decay_fraction)

    def batch_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss this rank backpropagates for one micro-batch: mean next-token cross-entropy."""
        return lm_loss(logits, batch["labels"])

    def train_step(self) -> dict[str, float]:
        """One optimizer step over ``grad_accum`` micro-batches; returns loss, grad norm, lr and token count."""
        c = self.config
        self.model.train()
        lr = self.lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        autocast = self.device.type == "cuda" and c.bf16
        loss_sum, tokens = 0.0, 0
        for micro in range(c.grad_accum):
            batch = {k: v.to(self.device) for k, v in self.source.batch(self.step, micro).items()}
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                logits = forward_logits(self.model, batch)
            loss = self.batch_loss(logits, batch)
            (loss / c.grad_accum).backward()
            loss_sum += loss.item()
            tokens += batch["input_ids"].numel()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Report the global mean loss (ranks hold equal shares of the batch), not this rank's.
            total = torch.tensor(loss_sum, dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(total)
            loss_sum = total.item() / torch.distributed.get_world_size()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
        grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()  # FSDP2
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        record = {"step": self.step, "loss": loss_sum / c.grad_accum, "grad_norm": grad_norm, "lr": lr,
                  "tokens": tokens}
        if self.routers is not None:
            kw = {"rate": c.balance_rate} if c.balance == "sign" else {"damping": c.balance_damping}
            record["expert_load_max_over_mean"] = self.routers.update(c.balance, **kw)
        self.history.append(record)
        return record

    # ------------------------------------------------------------------------------------------------ loop
    def fit(self) -> list[dict]:
        """Train up to ``config.steps``, with evaluation and checkpoints as configured; returns the history."""
        from tqdm.auto import tqdm

        c = self.config
        main_rank = not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
            torch.distributed.get_rank() == 0
        show = c.progress and main_rank
        bar = tqdm(total=c.steps, initial=self.step, disable=not show, desc="train", unit="step")
        t0, tok0 = time.perf_counter(), 0
        while self.step < c.steps:
            rec = self.train_step()
            tok0 += rec["tokens"]
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{tok0 / (time.perf_counter() - t0):.0f}",
                            lr=f"{rec['lr']:.2e}")
            last = self.step == c.steps
            if (c.eval_every and self.step % c.eval_every == 0) or last:
                rec.update({f"eval_{k}": v for k, v in evaluate(self.model, self.source, self.device).items()})
                if show:
                    bar.write(f"step {self.step}: loss {rec['loss']:.4f}  eval loss {rec['eval_loss']:.4f}  "
                              f"eval accuracy {rec['eval_accuracy']:.3f}")
            if c.out_dir and ((c.save_every and self.step % c.save_every == 0) or last):
                self.save(os.path.join(c.out_dir, f"step-{self.step}"))
        bar.close()
        return self.history

    # ----------------------------------------------------------------------------------------- checkpoints
    def save(self, path: str | os.PathLike) -> None:
        """Write the model (``save_pretrained``: config.json + safetensors) and ``trainer_state.pt`` into ``path``,
        via a temporary directory renamed into place, so an interrupted save never leaves a half checkpoint."""
        path = os.fspath(path)
        if self.sharded:
            from .distributed import save_sharded

            return save_sharded(self, path, tokenizer=self.tokenizer)
        tmp = f"{path}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(tmp)
        torch.save({"step": self.step, "optimizer": self.optimizer.state_dict(), "history": self.history,
                    "config": self.config.to_json()}, os.path.join(tmp, STATE_FILE))
        with open(os.path.join(tmp, "train_config.json"), "w", encoding="utf-8") as f:
            json.dump(self.config.to_json(), f, indent=2)
        if os.path.exists(path):
            old = f"{path}.old-{os.getpid()}"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            os.replace(tmp, path)

    def load_state(self, path: str | os.PathLike) -> None:
        """Restore the optimizer, the step and the history from a checkpoint whose weights the model already holds
        (see :func:`resume`)."""
        file = os.path.join(os.fspath(path), STATE_FILE)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file!r} not found: not a training checkpoint (written by Trainer.save)")
        state = torch.load(file, map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.history = list(state["history"])


def resume(path: str | os.PathLike, source: BatchSource, config: TrainConfig,
           device: str | torch.device = "cpu") -> Trainer:
    """A trainer that continues from checkpoint ``path``: same weights, optimizer state, step and history."""
    from kimi_linear.model import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32, device=device)
    trainer = Trainer(model, source, config)
    trainer.load_state(path)
    return trainer


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
