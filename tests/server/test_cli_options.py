"""`kimi-linear serve` options for the decode step: --device, --cuda-graphs/--no-cuda-graphs, --cuda-graph-max-len."""

from __future__ import annotations

import argparse

from kimi_linear.server.cli import add_serve_arguments, build_server


def parse(model: str, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args([model, *argv])


def test_cuda_graph_flags_parse():
    a = parse("ckpt")
    assert a.cuda_graphs is None and a.device == "auto" and a.cuda_graph_max_len == 8192
    assert parse("ckpt", "--cuda-graphs").cuda_graphs is True
    assert parse("ckpt", "--no-cuda-graphs").cuda_graphs is False
    assert parse("ckpt", "--cuda-graph-max-len", "1024").cuda_graph_max_len == 1024


def test_engine_gets_the_options(checkpoint):
    """On CPU: no graphs by default; --cuda-graphs runs the fixed-shape step eagerly (nothing to capture)."""
    for flags, on in (((), False), (("--cuda-graphs", "--cuda-graph-max-len", "512"), True)):
        _, loop = build_server(parse(checkpoint, "--device", "cpu", "--threads", "1", *flags))
        try:
            e = loop.engine
            assert (e.graphs is not None) == on and e.device.type == "cpu"
            if e.graphs is not None:
                assert e.graphs.lengths == [256, 512] and not e.graphs.capture and not e.graphs.steps
        finally:
            loop.close()
