"""Small pools behind an API key: overflow queues then completes, a client that disconnects mid-stream frees its
slot and blocks, the key is enforced on every route but /health."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from .conftest import reference


def client(server, key: str = "sekrit") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=300)


def test_api_key_enforced_except_health(small_server):
    assert httpx.get(small_server.url + "/health", timeout=10).status_code == 200
    with pytest.raises(openai.AuthenticationError) as e:
        client(small_server, "wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for path in ("/metrics", "/v1/models"):
        assert httpx.get(small_server.url + path, timeout=10).status_code == 401
    assert client(small_server).models.list().data[0].id == "tiny"


def test_overflowing_the_pools_queues_then_completes(small_server, ref_model):
    # 4 slots and 384 cached tokens; 6 requests of 100 + 16 tokens (8 blocks each) cannot all run at once.
    rng = random.Random(10)
    prompts = [[rng.randrange(256) for _ in range(100)] for _ in range(6)]
    c = client(small_server)
    peak = {"waiting": 0.0, "blocks": 0.0}
    done = threading.Event()

    def watch():
        while not done.is_set():
            m = small_server.metrics()
            peak["waiting"] = max(peak["waiting"], m["waiting"])
            peak["blocks"] = max(peak["blocks"], m["mla_blocks_used"])
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    try:
        with ThreadPoolExecutor(6) as ex:
            results = list(ex.map(lambda p: c.completions.create(
                model="tiny", prompt=p, max_tokens=16, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True}), prompts))
    finally:
        done.set()
        w.join()
    assert peak["waiting"] > 0 and peak["blocks"] <= 24
    for p, r in zip(prompts, results):
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].token_ids == reference(ref_model, p, 16, eos=False)
    m = small_server.metrics()
    assert m["running"] == 0 and m["mla_blocks_used"] == 0 and m["kda_slots_used"] == 0


def test_disconnect_mid_stream_frees_slot_and_blocks(small_server):
    c = client(small_server)
    before = small_server.metrics()
    stream = c.completions.create(model="tiny", prompt="a" * 100, max_tokens=300, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert small_server.metrics()["mla_blocks_used"] > 0
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = small_server.metrics()
        if m["running"] == 0 and m["mla_blocks_used"] == 0 and m["kda_slots_used"] == 0:
            break
        time.sleep(0.1)
    assert m["running"] == 0 and m["mla_blocks_used"] == 0 and m["kda_slots_used"] == 0, m
    assert m["requests_aborted_total"] == before["requests_aborted_total"] + 1
    assert m["generation_tokens_total"] - before["generation_tokens_total"] < 300
    r = c.completions.create(model="tiny", prompt="next", max_tokens=2, temperature=0)
    assert r.choices[0].text is not None

