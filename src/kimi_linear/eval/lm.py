"""The ``kimi_linear`` model class of lm-evaluation-harness: a checkpoint evaluated in-process on the serving engine.

It follows lm-eval's custom-model API (``lm_eval.api.model.LM``, through ``TemplateLM``, which turns
``(context, continuation)`` pairs into token ids the way every lm-eval model does) and answers exactly what
``kimi-linear serve`` answers to lm-eval's ``local-completions`` backend on the same checkpoint:

- the same tokenization (the checkpoint's tokenizer, no special tokens added; an empty context becomes the BOS id,
  else EOS), the same request order and batches (lm-eval's ``Collator``, ``batch_size`` requests at a time);
- ``loglikelihood``: each batch's prompts are scored together by the engine (``SamplingParams.prompt_logprobs``,
  one packed forward while they fit ``max_num_scored_tokens``); the continuation's log-prob is the sum over its
  tokens, greedy when each token's log-prob equals the best one at its position;
- ``generate_until``: each batch runs through the engine's continuous batching with the task's ``until`` (plus the
  EOS text, as lm-eval adds it), ``max_gen_toks`` (default 256) and ``temperature`` (default 0: greedy);
- ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens, all scored in batches.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from kimi_linear.engine import EngineConfig, LLMEngine, SamplingParams
from kimi_linear.engine.offline import run_batch
from kimi_linear.model import KimiLinearForCausalLM
from kimi_linear.model.default import resolve_model
from kimi_linear.model.tokenizer import load_tokenizer

log = logging.getLogger("kimi_linear.eval")

# generation_kwargs of a task that the engine serves; any other is refused by name.
GEN_KWARGS = ("until", "max_gen_toks", "max_tokens", "temperature", "do_sample", "top_p", "top_k")


def _positive_int(name: str, v: Any) -> int:
    """An int, or its digits as lm-eval's ``--model_args`` strings carry them, that is at least 1."""
    ok = (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, str) and v.strip().isdigit())
    if not ok or int(v) < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {v!r}")
    return int(v)


@register_model("kimi_linear")
class KimiLinearLM(TemplateLM):
    """A Kimi Linear checkpoint for lm-eval (``--model kimi_linear --model_args pretrained=DIR``).

    pretrained: checkpoint directory (default: the model shipped with the package). dtype: float32, bfloat16,
    float16 or auto (the checkpoint's; float32 on CPU for 16-bit files). device: cpu, cuda, cuda:N or auto.
    batch_size: requests handed to the engine at once (``auto``: all of a call's requests). max_length: most
    tokens of one scored input, longer ones keep their end (default: the model's context - 1). max_gen_toks:
    default generation length. max_num_seqs: engine slots (sequences generated at once). seed: sampling seed when
    a task samples (lm-eval's API models send 1234).
    """

    def __init__(self, pretrained: str | None = None, dtype: str = "auto", device: str | None = "auto",
                 batch_size: int | str | None = 16, max_batch_size: int | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, max_num_seqs: int = 16, seed: int = 1234,
                 engine_config: EngineConfig | None = None) -> None:
        super().__init__()
        path = resolve_model(pretrained)
        dev = self._device_of(device)
        self.model = KimiLinearForCausalLM.from_pretrained(path, dtype=dtype, device=dev).eval()
        self.tokenizer = load_tokenizer(path)
        self.path = path
        cfg = engine_config or EngineConfig(max_num_seqs=_positive_int("max_num_seqs", max_num_seqs))
        self.engine = LLMEngine(self.model, cfg, self.tokenizer)
        context = self.engine.max_context
        self.max_length = _positive_int("max_length", max_length) if max_length is not None else context - 1
        if self.max_length >= context:
            raise ValueError(f"`max_length` must be below the model's context ({context}), got {self.max_length}")
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self.seed = int(seed)
        if batch_size is None or str(batch_size).startswith("auto"):
            self.batch_size = 0                 # one batch: the engine packs and schedules them itself
        else:
            self.batch_size = _positive_int("batch_size", batch_size)
        self._device = dev

    @staticmethod
    def _device_of(device: str | None) -> torch.device:
        if device in (None, "auto"):
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            # lm-eval's CLI passes --device cuda:0 unless told otherwise.
            log.warning("kimi_linear: no CUDA device, evaluating on the CPU (device=%s asked)", device)
            return torch.device("cpu")
        return dev

    # ---------------------------------------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else int(self.engine.eos_ids[0])

    @property
    def prefix_token_id(self) -> int:
        # What lm-eval's API models prepend to an empty context: BOS when the tokenizer has one, else EOS.
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.path

    def tok_encode(self, string: str | list[str], add_special_tokens: bool | None = None, **kwargs: Any) -> Any:
        """Token ids of ``string`` (or of each string of a list), no special tokens added."""
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens), return_attention_mask=False
                              ).input_ids

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.path} has no chat template: run without --apply_chat_template")
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # --------------------------------------------------------------------------------------------- scoring
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(cache key, context ids, continuation ids) -> (log-prob of the continuation, greedy), batched."""
        for _, ctx, _ in requests:
            if not ctx:
                raise ValueError("a loglikelihood request needs context tokens (lm-eval puts the BOS/EOS id before "
                                 "an empty context)")

        def key(req: tuple[Any, list[int], list[int]]) -> tuple[int, tuple[int, ...]]:
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)           # longest first, as lm-eval's API models order them

        order = Collator(requests, sort_fn=key, group_by=None)
        res: list[tuple[float, bool]] = []
        bar = tqdm(total=len(requests), desc="kimi_linear loglikelihood", disable=disable_tqdm)
        for chunk in order.get_batched(n=self.batch_size):
            inputs, starts = [], []
            for _, ctx, cont in chunk:
                inp = (ctx + cont)[-self.max_length :]
                inputs.append(inp)
                starts.append(max(len(inp) - len(cont), 1))     # the first token of an input has no score
            outs = run_batch(self.engine, [(inp, SamplingParams(max_tokens=0, prompt_logprobs=1)) for inp in inputs])
            for (cache_key, _, _), out, start in zip(chunk, outs, starts):
                scored = out.prompt_logprobs[start:]
                answer = (sum(lp for _, lp, _ in scored), all(lp == alts[0][1] for _, lp, alts in scored))
                res.append(answer)
                if cache_key is not None:
                    self.cache_hook.add_partial("loglikelihood", cache_key, answer)
            bar.update(len(chunk))
        bar.close()
        return order.get_original(res)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each string's log-likelihood over lm-eval's disjoint rolling windows (inputs of ``max_length`` tokens),
        every window of every string scored in the same batches."""
        windows: list[tuple[None, list[int], list[int]]] = []
        owner: list[int] = []
        for i, (string,) in enumerate(req.args for req in requests):
            for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 1, context_len=1)):      # inputs of max_length tokens
                windows.append((None, ctx, pred))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------------------------------ generation
    def _params(self, gen_kwargs: dict[str, Any]) -> SamplingParams:
        """A task's generation_kwargs -> engine parameters (what lm-eval's local-completions sends)."""
        kw = copy.deepcopy(gen_kwargs)
        bad = sorted(set(kw) - set(GEN_KWARGS))
        if bad:
            raise ValueError(f"generation_kwargs {', '.join(f'`{k}`' for k in bad)} not supported by kimi_linear "
                             f"(supported: {', '.join(GEN_KWARGS)})")
        kw.pop("do_sample", None)           # like the API models: temperature decides (default 0, greedy)
        max_tokens = kw.pop("max_tokens") if "max_tokens" in kw else kw.pop("max_gen_toks", self.max_gen_toks)
        stop = handle_stop_sequences(kw.pop("until", None), self.tokenizer.eos_token)
        return SamplingParams(max_tokens=int(max_tokens), temperature=float(kw.pop("temperature", 0.0)),
                              top_p=float(kw.pop("top_p", 1.0)), top_k=int(kw.pop("top_k", 0)), seed=self.seed,
                              stop=[s for s in stop if s]).validate()

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (unless the task sets a temperature) continuations, cut before the first ``until`` string."""
        if not requests:
            return []
        contexts, all_kwargs = zip(*(req.args for req in requests))
        encodings = self.tok_encode(list(contexts))
        items = list(zip(contexts, all_kwargs, encodings))
        order = Collator(items, sort_fn=lambda x: -len(x[0]), group_by="gen_kwargs")
        res: list[str] = []
        bar = tqdm(total=len(requests), desc="kimi_linear generate_until", disable=disable_tqdm)
        for chunk in order.get_batched(n=self.batch_size, batch_fn=None):
            ctxs, kws, encs = zip(*chunk)
            params = self._params(kws[0])
            room = self.max_length - params.max_tokens
            if room < 1:
                raise ValueError(f"`max_gen_toks` {params.max_tokens} leaves no room for a prompt in max_length "
                                 f"{self.max_length}")
            outs = run_batch(self.engine, [(list(e)[-room:], params) for e in encs])
            for ctx, kw, out in zip(ctxs, kws, outs):
                res.append(out.text)
                self.cache_hook.add_partial("generate_until", (ctx, kw), out.text)
            bar.update(len(chunk))
        bar.close()
        return order.get_original(res)
