"""`kimi-linear serve` options: the decode step (--device, --cuda-graphs/--no-cuda-graphs) and the limits."""

from __future__ import annotations

import argparse

import pytest

from kimi_linear.server.cli import add_serve_arguments, build_server, fit_to_open_files, limits_from_args
from kimi_linear.server.limits import ServerLimits


def parse(model: str, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args([model, *argv])


def test_cuda_graph_flags_parse():
    a = parse("ckpt")
    assert a.cuda_graphs is None and a.device == "auto"
    assert parse("ckpt", "--cuda-graphs").cuda_graphs is True
    assert parse("ckpt", "--no-cuda-graphs").cuda_graphs is False


def test_engine_gets_the_options(checkpoint):
    """On CPU: no graphs by default; --cuda-graphs runs the fixed-shape step eagerly (nothing to capture)."""
    for flags, on in (((), False), (("--cuda-graphs",), True)):
        app, loop = build_server(parse(checkpoint, "--device", "cpu", "--threads", "1", *flags))
        try:
            e = loop.engine
            assert (e.graphs is not None) == on and e.device.type == "cpu"
            if e.graphs is not None:
                assert not e.graphs.capture and not e.graphs.buckets
            assert app.state.kl.limits == fit_to_open_files(limits_from_args(parse(checkpoint)))
        finally:
            loop.close()


def test_limit_options():
    d = limits_from_args(parse("ckpt"))
    assert d.max_body_bytes == 16 * 2**20 and d.max_json_depth == 64 and d.max_prompt_chars is None
    assert d.shutdown_timeout == 30 and d.timeout_request_head == 10 and d.timeout_keep_alive == 5
    assert d.limit_concurrency is None and 1 <= d.max_connections <= ServerLimits().max_connections
    got = limits_from_args(parse("ckpt", "--max-body-bytes", "2MiB", "--max-json-depth", "8", "--max-prompt-chars",
                                 "1000", "--max-connections", "32", "--timeout-request-head", "2.5",
                                 "--shutdown-timeout", "3", "--limit-concurrency", "64", "--max-header-bytes", "4096"))
    assert (got.max_body_bytes, got.max_json_depth, got.max_prompt_chars, got.max_connections) == (2**21, 8, 1000, 32)
    assert (got.timeout_request_head, got.shutdown_timeout, got.limit_concurrency, got.max_header_bytes) == \
        (2.5, 3, 64, 4096)
    assert limits_from_args(parse("ckpt", "--backlog", "64")).backlog == 64
    assert d.timeout_send == 60 and limits_from_args(parse("ckpt", "--timeout-send", "7.5")).timeout_send == 7.5
    for bad, field in ((("--max-json-depth", "1000"), "max_json_depth"), (("--shutdown-timeout", "0"), "shutdown"),
                       (("--max-connections", "0"), "max_connections"), (("--backlog", "0"), "backlog"),
                       (("--timeout-send", "0"), "timeout_send")):
        with pytest.raises(ValueError, match=field):
            limits_from_args(parse("ckpt", *bad))


@pytest.mark.parametrize("soft,hard", [(1024, 1024), (1024, 4096), (1024, 1 << 20), (200, 200), (80, 80),
                                       (20000, 20000)])
def test_connections_fit_the_open_file_limit(monkeypatch, soft, hard):
    """A flood's descriptors (the cap, three accept batches, a reserve) fit the soft limit, raised towards the hard
    one when short; only where the hard limit is short do the backlog and then the cap shrink, never below 1."""
    import resource

    from kimi_linear.server.connections import fit_open_file_limit, peak_descriptors

    now = {"soft": soft}
    monkeypatch.setattr(resource, "getrlimit", lambda _: (now["soft"], hard))

    def setrlimit(_, limits):
        assert limits[1] == hard and limits[0] <= hard
        now["soft"] = limits[0]
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    conn, backlog = fit_open_file_limit(1024, 2048)
    if peak_descriptors(1024, 2048) <= hard:
        assert (conn, backlog) == (1024, 2048) and now["soft"] == max(soft, peak_descriptors(1024, 2048))
    else:
        assert now["soft"] == hard and 1 <= conn <= 1024 and 16 <= backlog < 2048
        assert peak_descriptors(conn, backlog) <= hard or (conn == 1 and backlog == 16)
