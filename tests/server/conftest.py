"""Fixtures: a tiny random checkpoint and real servers (`python -m kimi_linear.server`) on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest
import torch

from kimi_linear.model import KimiLinearForCausalLM, preset_config
from kimi_linear.model.tokenizer import byte_level_tokenizer

EOS = 256


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(preset_config("tiny", eos_token_id=EOS, bos_token_id=257, pad_token_id=258))
    model.init_weights(0).save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def ref_model(checkpoint) -> KimiLinearForCausalLM:
    return KimiLinearForCausalLM.from_pretrained(checkpoint).eval()


def reference(model: KimiLinearForCausalLM, prompt: list[int], n: int, eos: bool = True) -> list[int]:
    """Single-request greedy tokens (through EOS inclusive, like the server's token_ids)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, eos_token_id=EOS if eos else None)
    toks = out[0, len(prompt):].tolist()
    return toks[: toks.index(EOS) + 1] if eos and EOS in toks else toks


def reference_with_logprobs(model: KimiLinearForCausalLM, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Single-request greedy tokens (through EOS) and each one's log-probability (what `logprobs` must report)."""
    out, logits = model.generate(torch.tensor([prompt]), max_new_tokens=n, eos_token_id=EOS, return_logits=True)
    toks = out[0, len(prompt):].tolist()
    toks = toks[: toks.index(EOS) + 1] if EOS in toks else toks
    return toks, [float(lg[0].log_softmax(-1)[t]) for lg, t in zip(logits, toks)]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    api_key: str | None

    def metrics(self) -> dict[str, float]:
        h = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        text = httpx.get(self.url + "/metrics", headers=h, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k.removeprefix("kimi_linear_")] = float(v)
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(checkpoint: str, *args: str, api_key: str | None = None) -> Server:
    port = _free_port()
    cmd = [sys.executable, "-m", "kimi_linear.server", checkpoint, "--port", str(port), "--served-model-name",
           "tiny", *args] + (["--api-key", api_key] if api_key else [])
    env = {**os.environ, "KIMI_LINEAR_API_KEY": ""}
    env.pop("KIMI_LINEAR_API_KEY")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return Server(url, proc, api_key)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy in 90 s")


def stop_server(s: Server) -> None:
    s.proc.terminate()
    try:
        s.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        s.proc.kill()


def flood(port: int, n: int) -> list[socket.socket]:
    """``n`` connections, every other one with an unfinished request head; non-blocking."""
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.setblocking(False)
        if i % 2:
            try:
                s.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")   # an unfinished request head
            except OSError:
                pass
        socks.append(s)
    return socks


def read_log(s: Server) -> str:
    """What the server printed since the last call (its stdout made non-blocking by the caller); "" if nothing."""
    try:
        return s.proc.stdout.read() or ""
    except (BlockingIOError, TypeError):        # nothing new (a non-blocking text pipe)
        return ""


def open_fds(pid: int) -> int:
    """Open file descriptors of process ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def all_closed_by_server(socks: list[socket.socket]) -> None:
    """Every socket gets closed by the server (evicted, or its head deadline passed): EOF or a reset."""
    open_ = list(socks)
    for _ in range(300):
        still = []
        for s in open_:
            try:
                if s.recv(4096):
                    still.append(s)
            except BlockingIOError:
                still.append(s)
            except OSError:
                pass
        open_ = still
        if not open_:
            break
        time.sleep(0.1)
    for s in socks:
        s.close()
    assert not open_, f"{len(open_)} flood sockets still open"



@pytest.fixture(scope="module")
def server(checkpoint):
    """16 slots, default pool; prefill chunk 16 so KDA snapshots land on every block boundary."""
    s = start_server(checkpoint, "--max-num-seqs", "16", "--prefill-chunk", "16")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def small_server(checkpoint):
    """4 slots and 24 blocks (384 tokens), with an API key: for overflow, disconnect and auth tests."""
    s = start_server(checkpoint, "--max-num-seqs", "4", "--num-blocks", "24", "--no-prefix-caching",
                     api_key="sekrit")
    yield s
    stop_server(s)
