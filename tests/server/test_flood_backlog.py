"""The descriptors of a connection flood while it arrives: bounded by --backlog (a server of its own, so the
/health poller of test_hostile's shared server, which keeps the default backlog, never sees this flood)."""

from __future__ import annotations

import threading

import httpx

from kimi_linear.model.default import resolve_model
from kimi_linear.server.connections import RESERVED_DESCRIPTORS, peak_descriptors

from .conftest import all_closed_by_server, flood, open_fds, start_server, stop_server


def test_flood_peak_descriptors_bounded_by_backlog():
    """While a flood arrives, the server's descriptors stay within the cap plus three accept batches of
    --backlog + 1 sockets (connections.peak_descriptors): with --backlog 8 and --max-connections 8, 300 sockets
    never become 300 descriptors at once. (With uvicorn's default backlog of 2048 all 300 can on a busy machine:
    with --max-connections 24 and two CPU burners beside it, 165-300 above idle; with --backlog 8, 30-38 against
    that bound's 51.)"""
    s = start_server(resolve_model(None), "--max-connections", "8", "--backlog", "8", "--timeout-request-head", "2")
    try:
        pid = s.proc.pid
        fds_idle = open_fds(pid)
        most, stop = [0], threading.Event()

        def sample():
            while not stop.is_set():
                most[0] = max(most[0], open_fds(pid))
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            socks = flood(int(s.url.rsplit(":", 1)[1]), 300)
            assert httpx.get(s.url + "/health", timeout=30).status_code == 200
        finally:
            stop.set()
            sampler.join()
        # + 4: descriptors the server opens for a moment besides sockets (a /proc read, a pipe)
        bound = fds_idle + peak_descriptors(8, 8) - RESERVED_DESCRIPTORS + 4
        assert most[0] <= bound, (fds_idle, most[0], bound)
        all_closed_by_server(socks)
    finally:
        stop_server(s)
