"""The shipped default model served with default options: 32 concurrent greedy requests return exactly what each
returns alone (on CPU ``--dtype auto`` computes the bf16 files in float32, where batching changes no token)."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest
import torch

from kimi_linear.model import KimiLinearForCausalLM, default

from .conftest import start_server, stop_server

shipped = pytest.mark.skipif(not default.ASSET_DIR.is_dir() or not any(default.ASSET_DIR.iterdir()),
                             reason="no shipped default model")


@shipped
def test_32_concurrent_greedy_requests_equal_their_one_by_one_answers():
    model = KimiLinearForCausalLM.from_pretrained(default.ASSET_DIR).eval()
    assert model.dtype == torch.float32
    eos = model.config.eos_token_id
    rng = random.Random(18)
    vocab = model.config.vocab_size
    jobs = [([rng.randrange(1, vocab) for _ in range(rng.randrange(1, 120))], rng.randrange(8, 40))
            for _ in range(32)]

    async def one(ac: openai.AsyncOpenAI, prompt: list[int], n: int) -> list[int]:
        r = await ac.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                        extra_body={"return_token_ids": True})
        return r.choices[0].token_ids

    server = start_server(str(default.ASSET_DIR))            # default options otherwise
    try:
        async def main():
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                          timeout=600) as ac:
                return await asyncio.gather(*(one(ac, p, n) for p, n in jobs))

        results = asyncio.run(main())
    finally:
        stop_server(server)
    for (prompt, n), toks in zip(jobs, results):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, eos_token_id=eos)[0, len(prompt):].tolist()
        ref = out[: out.index(eos) + 1] if eos in out else out
        assert toks == ref, (len(prompt), n)
