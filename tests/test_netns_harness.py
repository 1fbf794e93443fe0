"""``benchmarks/e2e/netns.py``: simulated hosts (network namespaces on a bridge) for ``run.py --hosts``.

Every test makes its own lab (namespaces named with a unique prefix, addresses in a 10.231.X.0/24 that
overlaps no route here) and checks afterwards, from the outside (``ip netns list``, ``ip link``, ``ip
route``, ``/proc``), that no namespace, link, route or process of it remains, also after a step that
fails on purpose and after SIGTERM. The only addresses used are the lab's own. Needs root and a kernel /
container that allows network namespaces; otherwise the tests skip saying which.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mooncake_fixtures import require_mooncake
from waiting import poll  # tests/ is on sys.path (the rootdir conftest's folder), in stage processes too

E2E = Path(__file__).resolve().parent.parent / "benchmarks" / "e2e"


def _load():
    spec = importlib.util.spec_from_file_location("e2e_netns", E2E / "netns.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["e2e_netns"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


netns = _load()

# An echo server (one connection, answers the bytes upper-cased) and its client, run inside namespaces.
ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
print("listening", flush=True)
c, peer = s.accept(); c.sendall(c.recv(100).upper() + b" from " + peer[0].encode()); c.close()
"""
ECHO_CLIENT = """
import socket, sys, time
for _ in range(100):
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5); break
    except OSError:
        time.sleep(0.1)
s.sendall(b"hello"); sys.stdout.write(s.recv(100).decode())
"""
# A process that leaves its process group (setsid in a forked child) and sleeps: only the namespace sweep
# of the teardown (``ip netns pids``) finds it. It prints the escaped child's pid.
ESCAPER = """
import os, sys, time
pid = os.fork()
if pid == 0:
    os.setsid(); time.sleep(600); os._exit(0)
print(pid, flush=True); time.sleep(600)
"""


@pytest.fixture(scope="module")
def root_netns():
    why = netns.problem()
    if why:
        pytest.skip(why)


def _assert_gone(prefix: str, pids: list[int], subnet, ns_inodes) -> None:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in names, names
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert prefix not in links, links
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    assert str(subnet.network_address) not in routes, routes
    for pid in pids:
        assert not netns._alive(pid), f"process {pid} is still running"
    # no live process anywhere is still inside one of the lab's namespaces
    inside = [pid for pid, ino in netns._proc_net_inodes().items() if ino in set(ns_inodes) and netns._alive(pid)]
    assert not inside, inside


def _wait_line(path: Path, timeout: float = 30) -> str:
    text = poll(lambda: (path.read_text() if path.exists() else "").strip(), timeout)
    assert text, f"nothing written to {path} in {timeout} s"
    return text.splitlines()[0]


def test_echo_between_hosts_then_a_failed_step_leaves_nothing(root_netns, tmp_path):
    lab = netns.NetnsLab(3, names=["mooncake", "api", "stage1"], grace=2)
    pids: list[int] = []
    with pytest.raises(netns.StepFailed, match=r"step 'stage exits 1' on stage1 \(10\.231\.\d+\.12\) exited with 1"):
        with lab:
            mc, api, s1 = lab.hosts
            assert [h.addr.rsplit(".", 1)[1] for h in lab.hosts] == ["10", "11", "12"]
            assert all(h.addr.startswith("10.231.") for h in lab.hosts)
            assert {lab.prefix + "-h0", lab.prefix + "-h1", lab.prefix + "-h2", lab.switch_ns} <= set(
                netns.list_namespaces()
            )
            # TCP between two namespaces over the bridge, on the lab's addresses only
            echo = [sys.executable, "-c", ECHO_SERVER, api.addr, "7000"]
            server = lab.spawn(api, echo, name="echo", log=tmp_path / "echo.log")
            pids.append(server.popen.pid)
            r = lab.run(s1, [sys.executable, "-c", ECHO_CLIENT, api.addr, "7000"], step="echo client", timeout=60)
            assert r.stdout.decode() == f"HELLO from {s1.addr}"  # the peer seen is stage1's own address
            assert server.popen.wait(timeout=30) == 0
            # isolation: host mooncake has no route to the server's port on its own loopback
            r = lab.run(mc, [sys.executable, "-c", ECHO_CLIENT.replace("range(100)", "range(1)"), "127.0.0.1", "7000"],
                        check=False, timeout=60)  # fmt: skip
            assert r.returncode != 0
            # a long-lived process whose child escapes its process group, in another namespace
            esc_log = tmp_path / "escaper.log"
            escaper = lab.spawn(mc, [sys.executable, "-c", ESCAPER], name="escaper", log=esc_log)
            pids += [escaper.popen.pid, int(_wait_line(esc_log))]
            assert all(netns._alive(p) for p in pids[1:])
            assert set(pids[1:]) <= set(lab.pids_in(mc.ns))
            # the step that fails on purpose
            lab.run(s1, [sys.executable, "-c", "raise SystemExit(1)"], step="stage exits 1")
            raise AssertionError("not reached: the step above fails")
    assert lab.leftovers == {"namespaces": [], "links": [], "processes": [], "routes": []}
    _assert_gone(lab.prefix, pids, lab.subnet, lab._ns_inodes.values())


def test_a_process_that_dies_early_is_a_failed_step(root_netns, tmp_path):
    lab = netns.NetnsLab(2, grace=2)
    with pytest.raises(netns.StepFailed, match=r"bad-master on h0 .* exited with 3; log .*\nno such option"):
        with lab:
            p = lab.spawn(lab.hosts[0], [sys.executable, "-c", "import sys; print('no such option'); sys.exit(3)"],
                          name="bad-master", log=tmp_path / "m.log")  # fmt: skip
            p.popen.wait(timeout=30)
            lab.expect_running(p)
    _assert_gone(lab.prefix, [p.popen.pid], lab.subnet, lab._ns_inodes.values())


def test_the_driver_reaches_a_host_and_the_route_goes_with_the_lab(root_netns, tmp_path):
    with netns.NetnsLab(1, grace=2) as lab:
        (h,) = lab.hosts
        routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
        assert f"{lab.subnet} dev {lab.prefix}d" in routes
        lab.spawn(h, [sys.executable, "-c", ECHO_SERVER, h.addr, "7001"], log=tmp_path / "s.log")
        _wait_line(tmp_path / "s.log")
        with socket.create_connection((h.addr, 7001), timeout=10) as s:
            s.sendall(b"hi")
            assert s.recv(100) == f"HI from {lab.driver_addr}".encode()
    _assert_gone(lab.prefix, [], lab.subnet, lab._ns_inodes.values())


DRIVER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import netns
with netns.NetnsLab(2, grace=2) as lab:
    p = lab.spawn(lab.hosts[1], [sys.executable, "-c", "import time; time.sleep(600)"])
    print(lab.prefix, lab.subnet, p.popen.pid, *lab._ns_inodes.values(), flush=True)
    time.sleep(600)
"""


def test_sigterm_to_the_harness_cleans_up(root_netns):
    drv = subprocess.Popen([sys.executable, "-c", DRIVER, str(E2E)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)  # fmt: skip
    try:
        prefix, subnet, pid, *inodes = drv.stdout.readline().split()
        assert netns._alive(int(pid)) and len([n for n in netns.list_namespaces() if n.startswith(prefix)]) == 3
        drv.send_signal(signal.SIGTERM)
        drv.wait(timeout=60)
    finally:
        if drv.poll() is None:
            drv.kill()
            drv.wait()
    err = drv.stderr.read()
    assert "Interrupted: interrupted by SIGTERM" in err, err  # unwound through the lab, not killed outright
    import ipaddress

    _assert_gone(prefix, [int(pid)], ipaddress.ip_network(subnet), [int(i) for i in inodes])


def test_processes_in_the_lab_s_namespaces_are_on_this_machine_for_the_peer_hello(root_netns):
    """The hosts share one kernel and one PID namespace, so a receiver's process id means the same process to its
    sender: the peer hello's machine id (boot id and PID namespace, not the host name) is the same in every one."""
    from omni_accum.integrations.vllm_omni.peer import machine_id

    code = "from omni_accum.integrations.vllm_omni.peer import machine_id; print(machine_id())"
    with netns.NetnsLab(1, grace=2) as lab:
        r = lab.run(lab.hosts[0], [sys.executable, "-c", code], step="machine id", timeout=120)
    assert r.stdout.decode().strip() == machine_id()


def test_not_root_says_so(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.problem() == "network namespaces need root (this process runs as uid 1000)"
    with pytest.raises(netns.NetnsUnavailable, match="need root"):
        with netns.NetnsLab(2):
            pass


def test_a_subnet_overlapping_a_route_is_not_picked(monkeypatch):
    import ipaddress

    taken = [ipaddress.ip_network("10.231.5.0/24"), ipaddress.ip_network("10.231.6.0/23")]
    monkeypatch.setattr(netns, "root_networks", lambda: taken)
    assert str(netns.pick_subnet(start=5)) == "10.231.8.0/24"
    monkeypatch.setattr(netns, "root_networks", lambda: [ipaddress.ip_network("10.231.0.0/16")])
    with pytest.raises(netns.NetnsUnavailable, match="overlaps a route"):
        netns.pick_subnet()


def _fake_ip(tables: dict[tuple[str, ...], str]):
    """``netns.ip`` answering from ``tables`` (the command's arguments -> its stdout); anything else fails."""

    def ip(*args, check=True, timeout=30):
        if args not in tables:
            raise AssertionError(f"unexpected `ip {' '.join(args)}`")
        return subprocess.CompletedProcess(["ip", *args], 0, tables[args], "")

    return ip


def test_a_subnet_the_host_talks_to_through_its_default_gateway_is_not_picked(monkeypatch):
    """A real 10.231.X.0/24 reached through the default gateway is in no route of its own: the addresses the host
    talks to or is told of (gateway, neighbours, socket peers, name servers, /etc/hosts) count as taken."""
    import ipaddress

    routes = ("default via 10.231.3.1 dev eth0\n"
              "10.231.4.0/24 dev eth1 proto kernel scope link src 10.231.4.7\n"
              "local 127.0.0.1 dev lo table local proto kernel scope host src 127.0.0.1\n")  # fmt: skip
    monkeypatch.setattr(netns, "ip", _fake_ip({
        ("-4", "route", "show", "table", "all"): routes,
        ("-4", "-o", "addr", "show"): "2: eth1    inet 10.231.4.7/24 brd 10.231.4.255 scope global eth1\n",
        ("-4", "neigh", "show"): "10.231.5.9 dev eth0 lladdr 02:00:00:00:00:01 REACHABLE\n",
    }))  # fmt: skip
    peer = int.from_bytes(ipaddress.IPv4Address("10.231.6.20").packed, "little")  # /proc/net/tcp's byte order
    files = {
        "/proc/net/tcp": f"  sl  local_address rem_address   st\n   0: 0100007F:1F90 {peer:08X}:C350 01\n",
        "/proc/net/udp": "  sl  local_address rem_address   st\n   0: 00000000:0044 00000000:0000 07\n",
        "/etc/resolv.conf": "# a comment\nnameserver 10.231.7.53\nnameserver fd00::53\n",
        "/etc/hosts": "127.0.0.1 localhost\n::1 localhost\n10.231.8.4 registry.internal  # a mirror\n",
    }
    monkeypatch.setattr(netns, "_read", lambda path: files.get(path, ""))
    taken = netns.root_networks()
    for addr in ("10.231.3.1", "10.231.4.0/24", "10.231.5.9", "10.231.6.20", "10.231.7.53", "10.231.8.4"):
        assert ipaddress.ip_network(addr) in taken, addr
    assert str(netns.pick_subnet(start=3)) == "10.231.9.0/24"  # 3 to 8 are each known to the host


def test_labs_choose_their_subnet_one_at_a_time_under_root_s_lock(tmp_path):
    import threading

    lock = tmp_path / "netns.lock"
    with netns.subnet_lock(lock):
        got: list[BaseException] = []
        t = threading.Thread(target=lambda: _try_lock(lock, got))
        t.start()
        t.join(timeout=30)
        assert len(got) == 1 and isinstance(got[0], netns.NetnsUnavailable), got
        assert f"the subnet lock {lock}: another lab held it for 0 s" in str(got[0])
    with netns.subnet_lock(lock, wait_s=0):  # released: taken at once
        pass
    os.chmod(lock, 0o666)  # writable by others: not root's own
    with pytest.raises(netns.NetnsUnavailable, match="not a regular file of root's, writable by root only"):
        with netns.subnet_lock(lock, wait_s=0):
            pass
    link = tmp_path / "link.lock"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(netns.NetnsUnavailable, match=f"the subnet lock {link}"):
        with netns.subnet_lock(link, wait_s=0):
            pass
    assert not (tmp_path / "elsewhere").exists()


def _try_lock(lock: Path, got: list) -> None:
    try:
        with netns.subnet_lock(lock, wait_s=0):
            got.append(AssertionError("taken while another holder had it"))
    except BaseException as e:  # noqa: BLE001 - the test looks at it
        got.append(e)


def test_a_namespace_is_recorded_before_it_is_made(monkeypatch, tmp_path):
    """``ip netns add`` that made the namespace and then failed (or a signal right after it): the lab's teardown
    still knows the namespace, so it removes it."""
    made: list[str] = []

    def ip(*args, check=True, timeout=30):
        if args[:2] == ("netns", "add"):
            made.append(args[2])
            raise netns.Interrupted(signal.SIGTERM)  # after the kernel made it, before the call returned
        raise AssertionError(f"unexpected `ip {' '.join(args)}`")

    monkeypatch.setattr(netns, "ip", ip)
    monkeypatch.setattr(netns, "LOCK_PATH", tmp_path / "netns.lock")
    lab = netns.NetnsLab(2, subnet=__import__("ipaddress").ip_network("10.231.77.0/24"))
    with pytest.raises(netns.Interrupted):
        lab._create()
    assert made == [lab.switch_ns] and lab._namespaces == [lab.switch_ns]


# ---------------------------------------------------------------------------------------------- #
# run.py --hosts: the whole mode, with a stand-in `vllm-omni` whose stage 2 fails on purpose
# ---------------------------------------------------------------------------------------------- #

# Stands in for `vllm-omni serve` (the real server is the benchmark's, ~13 GB): the head listens on its
# --omni-master-port, headless stage 1 forks a child that leaves its process group, headless stage 2 exits 1
# once stage 1's child exists. The real mooncake_master runs in its namespace.
FAKE_VLLM_OMNI = """
import os, socket, sys, time
a = sys.argv
opt = lambda name: a[a.index(name) + 1]
pids = os.environ["FAKE_PIDS"]
open(os.path.join(pids, f"{os.getpid()}.pid"), "w").write(os.environ.get("OMNI_ACCUM_DEPLOYMENT", "-"))
if "--headless" in a and opt("--stage-id") == "2":
    for _ in range(300):
        if os.path.exists(os.path.join(pids, "escaped")):
            break
        time.sleep(0.1)
    print("stage 2 refuses to start (on purpose)", flush=True)
    sys.exit(1)
if "--headless" in a:
    if os.fork() == 0:
        os.setsid()
        open(os.path.join(pids, "escaped.tmp"), "w").write(str(os.getpid()))
        os.rename(os.path.join(pids, "escaped.tmp"), os.path.join(pids, "escaped"))
        time.sleep(600)
        os._exit(0)
    time.sleep(600)
s = socket.socket()
s.bind((opt("--omni-master-address"), int(opt("--omni-master-port"))))
s.listen()
time.sleep(600)
"""


def test_run_py_hosts_cleans_up_after_a_stage_fails(root_netns, tmp_path):
    import json

    require_mooncake()  # a failure under CI=true, as everywhere else
    # a virtualenv whose bin/ holds the stand-in: run.py's VENV_BIN is its interpreter's folder
    venv = Path(sys.prefix)
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (tmp_path / "venv" / "pyvenv.cfg").write_bytes((venv / "pyvenv.cfg").read_bytes())
    # its site-packages: links to this one's entries, and torchvision's dist-info (run.py refuses a virtualenv
    # without it: `vllm-omni serve` cannot start there)
    (real_site,) = (venv / "lib").glob("python*/site-packages")
    site = tmp_path / "venv" / "lib" / real_site.parent.name / "site-packages"
    site.mkdir(parents=True)
    for entry in real_site.iterdir():
        (site / entry.name).symlink_to(entry)
    if not list(site.glob("torchvision-*.dist-info")):
        (site / "torchvision-0.0.dist-info").mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    fake = bin_dir / "vllm-omni"
    fake.write_text(f"#!{sys.executable}\n{FAKE_VLLM_OMNI}")
    fake.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    pids = tmp_path / "pids"
    pids.mkdir()
    out = tmp_path / "out.json"
    r = subprocess.run(
        [str(bin_dir / "python"), str(E2E / "run.py"), "--hosts", "4", "--smoke", "--arms", "qwen3-omni",
         "--model", str(model), "--start-timeout", "120", "--stop-grace", "5", "--work-dir", str(tmp_path / "runs"),
         "--json", str(out)],
        env={**os.environ, "FAKE_PIDS": str(pids)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    (arm,) = json.loads(out.read_text())["arms"]
    assert arm["started"] is False
    assert "stage2 (waiting for the API server) on stage2" in arm["error"] and "exited with 1" in arm["error"]
    assert "stage 2 refuses to start (on purpose)" in arm["error"]
    lab = arm["hosts"]
    assert [h["role"] for h in lab["hosts"]] == ["mooncake", "api", "stage1", "stage2"]
    assert all(h["addr"].startswith("10.231.") for h in lab["hosts"])
    # every host ran what the mode says: the real master, the head with stage 0, two headless stages
    assert "--rpc_address=" + lab["hosts"][0]["addr"] in " ".join(lab["commands"]["mooncake-master"])
    head = " ".join(lab["commands"]["api"])
    assert "--stage-id 0 --omni-master-address " + lab["hosts"][1]["addr"] in head
    for k in (1, 2):
        cmd = " ".join(lab["commands"][f"stage{k}"])
        assert f"--headless --stage-id {k}" in cmd and f"--omni-replica-address {lab['hosts'][k + 1]['addr']}" in cmd
        deploy = (Path(arm["server_log"]).parent / f"deploy-stage{k}.yaml").read_text()
        assert f"host: {lab['hosts'][k + 1]['addr']}" in deploy
        assert f"master: {lab['hosts'][0]['addr']}:50151" in deploy
    assert arm["stop"]["clean"] is True and arm["stop"]["exit_statuses"]["stage2"] == 1
    assert arm["stop"]["netns_left"] == {"namespaces": [], "links": [], "processes": [], "routes": []}
    # from the outside: no namespace, link, route of the lab; no process it started (the escaped child too)
    started = [int(p.stem) for p in pids.glob("*.pid")] + [int((pids / "escaped").read_text())]
    assert len(started) == 4  # the head, stage 1, stage 2 and stage 1's escaped child
    # one omni-accum deployment token for the whole server (the hellos' keys), not one per launch
    tokens = {p.read_text() for p in pids.glob("*.pid")}
    assert tokens == {lab["omni_accum_deployment"]} and lab["omni_accum_deployment"].startswith("hosts-")
    mc_pid = arm["processes"][0]["pid"] if arm["processes"] else None
    import ipaddress

    _assert_gone(lab["prefix"], started + ([mc_pid] if mc_pid else []), ipaddress.ip_network(lab["subnet"]), [])


# ---------------------------------------------------------------------------------------------- #
# run.py --hosts-fault: the master restarted, a host's link down and up again
# ---------------------------------------------------------------------------------------------- #


def _hosts_module():
    sys.path.insert(0, str(E2E))
    try:
        import hosts
    finally:
        sys.path.remove(str(E2E))
    return hosts


def test_a_fault_spec_names_its_bad_part_and_the_valid_choices():
    hosts = _hosts_module()
    roles = ["mooncake", "api", "stage1", "stage2"]
    assert hosts.parse_fault("master-restart", roles) == {"kind": "master-restart", "role": None, "seconds": 5.0,
                                                          "spec": "master-restart"}  # fmt: skip
    assert hosts.parse_fault("link-down:stage1:3", roles)["role"] == "stage1"
    assert hosts.parse_fault("link-down:api", roles)["seconds"] == 5.0
    for bad, said in (("reboot", "unknown fault 'reboot'"),
                      ("link-down", "which host? (link-down:ROLE[:SECONDS], ROLE one of mooncake"),
                      ("link-down:stage9", "'stage9' is not a host of this deploy (mooncake, api, stage1, stage2)"),
                      ("master-restart:soon", "'soon' is not a number of seconds"),
                      ("link-down:api:1:2", "too many parts")):  # fmt: skip
        with pytest.raises(hosts.HostsUsageError) as e:
            hosts.parse_fault(bad, roles)
        assert said in str(e.value) and repr(bad) in str(e.value)


@pytest.mark.parametrize("change, said", [
    (lambda d: d["connectors"]["connector_of_mooncake"].__setitem__("extra", None),
     "connectors.connector_of_mooncake.extra is None, not a mapping"),
    (lambda d: d["connectors"].__setitem__("x", "MooncakeStoreConnector"),
     "connectors.x is 'MooncakeStoreConnector', not a mapping; give {name: ..., extra: {...}}"),
    (lambda d: d.__setitem__("connectors", ["MooncakeStoreConnector"]), "connectors is a list; give a mapping"),
])  # fmt: skip
def test_a_deploy_the_hosts_cannot_run_is_a_usage_error_before_anything_starts(tmp_path, change, said):
    """``plan()`` (run.py's check before any lab or master) refuses what ``host_deploy`` would trip over later."""
    import yaml

    hosts = _hosts_module()
    doc = yaml.safe_load((E2E / "configs" / "qwen3_omni_cpu_mooncake.yaml").read_text())
    change(doc)
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(yaml.safe_dump(doc))
    with pytest.raises(hosts.HostsUsageError) as e:
        hosts.plan(deploy, 4)
    assert said in str(e.value) and str(deploy) in str(e.value)


def test_the_stages_stop_before_the_head_and_every_master_last(tmp_path):
    hosts = _hosts_module()
    deploy = E2E / "configs" / "qwen3_omni_cpu_mooncake.yaml"
    server = hosts.HostsServer(hosts=4, deploy=deploy, model=tmp_path, venv_bin=tmp_path, arm_dir=tmp_path,
                               start_timeout=1, grace=1, log=lambda *a: None)  # fmt: skip
    popen = type("Done", (), {"returncode": 0, "pid": 0, "poll": lambda self: 0})()
    for name in ("mooncake-master", "api", "stage1", "stage2", "mooncake-master-2"):  # started in this order
        server.lab.procs.append(netns.Proc(name, None, popen, []))
    order: list[str] = []
    server.lab.close = lambda raise_on_leftovers: (order.extend(p.name for p in reversed(server.lab.procs)), {})[1]
    assert server.stop([])["clean"] is True
    assert order == ["stage2", "stage1", "api", "mooncake-master-2", "mooncake-master"]


def _link_up(ns: str, link: str) -> bool:
    out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "dev", link], capture_output=True, text=True).stdout
    return ",UP" in out or "<UP" in out


def test_a_master_restart_and_a_link_down_are_made_recorded_and_leave_nothing(root_netns, tmp_path):
    """The real ``mooncake_master`` in its namespace: SIGKILLed and a fresh one answering on the same address;
    a stage host's link down (its address unreachable from the harness) and up again; the lab then closes clean."""
    import threading

    require_mooncake()  # a failure under CI=true, as everywhere else
    hosts = _hosts_module()
    model = tmp_path / "model"
    model.mkdir()
    server = hosts.HostsServer(hosts=4, deploy=E2E / "configs" / "qwen3_omni_cpu_mooncake.yaml", model=model,
                               venv_bin=Path(sys.executable).parent, arm_dir=tmp_path, start_timeout=60, grace=2,
                               log=lambda *a: None)  # fmt: skip
    server.open()
    try:
        first = server.start_master(dict(os.environ))
        # as run.py makes it: from the timer's thread, which must outlive the fresh master (a process gets
        # SIGTERM when the thread that started it ends: PR_SET_PDEATHSIG)
        server.arm_fault(hosts.parse_fault("master-restart:0.5", server.roles), 0.1)
        poll(lambda: server.fault_record.get("done") or "error" in server.fault_record, 90, 0.1)
        rec = server.fault_record
        assert rec.get("done"), rec
        assert rec["done"] and rec["killed_pid"] == first.popen.pid and first.popen.returncode == -9
        assert rec["new_pid"] != rec["killed_pid"] and rec["master_answers_after_s"] >= 0.5
        time.sleep(2)
        fresh = [p for p in server.lab.procs if p.popen.pid == rec["new_pid"]][0]
        assert fresh.popen.poll() is None, "the fresh master died with the thread that started it"
        mc = server.lab.host("mooncake")
        assert hosts._connects(mc.addr, hosts.MOONCAKE_RPC_PORT)  # the fresh master, on the same address
        h = server.lab.host("stage1")
        assert _link_up(h.ns, h.link)
        t = threading.Thread(target=server.inject, args=(hosts.parse_fault("link-down:stage1:3", server.roles),))
        t.start()
        assert poll(lambda: not _link_up(h.ns, h.link), 60), "the link never went down"  # seen down in its 3 s
        t.join(timeout=30)
        assert _link_up(h.ns, h.link) and server.fault_record["done"] and server.fault_record["link"] == h.link
        assert fresh.popen.poll() is None
        report = server.fault_report(None)
        assert report["running"]["mooncake-master"] is False and report["running"]["mooncake-master-2"] is True
        assert "log_offsets" not in report and report["health"] is None  # no API server in this lab
    finally:
        stop = server.stop([])
    assert stop["clean"] is True, stop
    assert stop["netns_left"] == {"namespaces": [], "links": [], "processes": [], "routes": []}
    assert not netns._alive(rec["new_pid"])
