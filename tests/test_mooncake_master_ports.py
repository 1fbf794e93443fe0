"""A Mooncake master started by the tests or the bench picks its ports, then binds them: another process may take
one in between. The three ports are distinct, and a master that exits at start is started again on new ones."""

from __future__ import annotations

import socket

from mooncake_fixtures import require_mooncake

from omni_accum.bench import mooncake_services as services


def test_the_ports_picked_at_once_are_distinct():
    for _ in range(50):
        ports = services.free_ports(3)
        assert len(set(ports)) == 3 and all(0 < p < 65536 for p in ports)


def test_a_master_whose_port_was_taken_starts_again_on_other_ports(tmp_path, monkeypatch):
    require_mooncake()
    taken = socket.socket()
    taken.bind((services.HOST, 0))
    taken.listen()
    busy = taken.getsockname()[1]
    picks: list[list[int]] = []
    real = services.free_ports

    def first_busy(n: int) -> list[int]:
        got = real(n)
        if not picks:
            got[0] = busy  # the rpc port, taken by another process since it was picked
        picks.append(got)
        return got

    monkeypatch.setattr(services, "free_ports", first_busy)
    monkeypatch.setattr(services.MooncakeServices, "_start_holder", lambda self, timeout: None)
    svc = services.MooncakeServices(log_dir=str(tmp_path))
    try:
        svc.start(timeout=60)
        assert len(picks) == 2 and svc.rpc_port == picks[1][0] != busy, picks
        assert svc.rpc_port in services.listening_ports(svc.pids)
    finally:
        svc.stop()
        taken.close()
    assert not services.listening_ports(svc.pids)
