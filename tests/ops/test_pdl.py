"""Programmatic dependent launch (ops/triton/pdl.py): never applies off a CUDA sm_90+ device, so the interpreter
and CPU paths launch every kernel exactly as before."""

import torch

from kimi_linear.ops.triton import pdl


def test_pdl_off_on_cpu_even_when_enabled(monkeypatch):
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False}


def test_pdl_never_enabled_under_the_interpreter(monkeypatch):
    import importlib

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        assert importlib.reload(pdl).ENABLED is False
    finally:
        monkeypatch.undo()
        importlib.reload(pdl)
