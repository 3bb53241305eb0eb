"""A tokenizer with a chat template: the chat route renders it (in process, FastAPI's TestClient)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from kimi_linear.engine import EngineConfig, LLMEngine
from kimi_linear.engine.background import EngineLoop
from kimi_linear.model.tokenizer import byte_level_tokenizer
from kimi_linear.server.app import ServerState, create_app

from .conftest import reference

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<bot>{% endif %}")


def test_chat_uses_the_tokenizers_template(ref_model):
    tok = byte_level_tokenizer()
    tok.chat_template = TEMPLATE
    loop = EngineLoop(LLMEngine(ref_model, EngineConfig(max_num_seqs=2), tok))
    try:
        with TestClient(create_app(ServerState(loop, tok, "tiny"))) as http:
            msgs = [{"role": "user", "content": "2+2?"}]
            r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 6,
                                                       "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            ids = tok.encode("<user>2+2?\n<bot>", add_special_tokens=False)
            choice = r.json()["choices"][0]
            assert choice["prompt_token_ids"] == ids
            assert choice["token_ids"] == reference(ref_model, ids, 6)
    finally:
        loop.close()
