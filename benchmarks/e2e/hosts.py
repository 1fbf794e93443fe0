"""``run.py --hosts N``: one arm's server with its stages on simulated hosts (network namespaces, ``netns.py``).

Per arm, a fresh lab of N namespaces on one bridge (addresses ``10.231.X.10+I``, the harness itself at
``10.231.X.1``) runs, each in its own namespace:

* host ``mooncake``: ``mooncake_master`` (RPC port 50151, HTTP metadata 8080, metrics 9003 on its address);
* host ``api``: the head, ``vllm-omni serve MODEL --omni --host ADDR --port 8000 --stage-id 0
  --omni-master-address ADDR --omni-master-port 15000``: the API server, vllm-omni's orchestrator and
  master server (``OmniMasterServer``), and stage 0 (vllm-omni 0.30.0's head process runs the stage its
  ``--stage-id`` names and waits for the others to register);
* host ``stageK`` (K = 1, 2, ...): ``vllm-omni serve MODEL --omni --headless --stage-id K
  --omni-master-address API_ADDR --omni-master-port 15000 --omni-replica-address ADDR``.

Every stage gets its own copy of the deploy (``<arm dir>/deploy-<host>.yaml``) whose Mooncake connectors
name its own address (``host``) and the master's (``master``, ``metadata_server``), and
``MC_TCP_BIND_ADDRESS`` / ``VLLM_HOST_IP`` = its address. omni-accum is on or off per arm through the same
environment as on one host (``OMNI_ACCUM_POLICY``, ``OMNI_ACCUM_VLLM_OMNI``); every host's processes get
one ``OMNI_ACCUM_DEPLOYMENT`` per arm (on one host the API server's plugin draws it and the stage
processes it starts inherit it; separately launched stages need it set, else a receiver's hello is put
under another deployment's key and its sender never finds it: docs/vllm-omni.md, "Deployment token").

What stays shared between the simulated hosts (one kernel, one file system): ``/dev/shm`` (so a
``SharedMemoryConnector`` would still "work": the deploy is refused unless every connector is a Mooncake
one), the run folder, ``OMNI_ACCUM_STATUS_DIR`` and ``PROMETHEUS_MULTIPROC_DIR`` (so the head's
``/metrics`` shows the stage processes' counters, as on one host; on real machines each would have its
own), CPU and memory.

Faults (``run.py --hosts-fault``, ``--kill-after-s`` seconds after the first benchmark starts, once):
``master-restart[:DOWN_S]`` SIGKILLs ``mooncake_master`` and starts a fresh one on the same address after
DOWN_S seconds (default 5; the store's objects are lost with it); ``link-down:ROLE[:SECONDS]`` takes host
ROLE's link down for SECONDS (default 5) and up again. The arm's ``fault`` entry says what was done when,
how long the master took to answer again, ``/health`` and the processes per host afterwards, the client's
answered and failed requests, and each host's log lines after the fault that name an error, a time-out, a
death or a restart.

Stopping: SIGTERM to each process group, the stages first (the newest first), then the head, then the master
(each master: the fresh one of a ``master-restart`` fault too, last, so no stage loses its store while it stops),
SIGKILL after the grace, then everything still in the namespaces, then the namespaces and links
(``NetnsLab.close``), also when a step fails (an exit before ready, a time-out).
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import netns
from e2e_options import stage_id_of
from e2e_procs import alive, http_json, proc_info
from e2e_watch import client_errors, event_lines

MOONCAKE_RPC_PORT = 50151
MOONCAKE_HTTP_PORT = 8080
MOONCAKE_METRICS_PORT = 9003
API_PORT = 8000
OMNI_MASTER_PORT = 15000
# vllm-omni 0.30.0's own, and omni-accum's with the tensor fast path (configs/qwen3_omni_cpu_mooncake_fast.yaml)
MOONCAKE_CONNECTORS = ("MooncakeStoreConnector", "OmniAccumMooncakeConnector")
# run with the server's python: the path of mooncake_master inside its Mooncake package
MASTER_BINARY = "from omni_accum.bench.mooncake_services import master_binary; print(master_binary())"


class HostsUsageError(ValueError):
    """A deploy or host count the hosts mode cannot run (run.py turns it into a usage error)."""


def prerequisites(venv_python: str | Path) -> str | None:
    """Why the hosts mode cannot run here, or None: root, ``ip`` (installed with apt-get as root when
    missing), network namespaces permitted, Mooncake importable in the harness's virtualenv."""
    if os.geteuid() != 0:
        return f"it needs root to make network namespaces (this process runs as uid {os.geteuid()})"
    missing = netns.ensure_ip_command(install=True)
    if missing:
        return missing
    why = netns.problem()
    if why:
        return why
    r = subprocess.run([str(venv_python), "-c", MASTER_BINARY], capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return (
            f"Mooncake is not usable in {venv_python} ({last}): {Path(venv_python).parent}/python -m pip install "
            "'mooncake-transfer-engine-non-cuda==0.3.13.post1' (omni-accum's mooncake extra); "
            "apt-get install libibverbs1"
        )
    return None


def stage_ids(doc: dict[str, Any], where: str | Path = "the deploy") -> list[int]:
    """The deploy's stage ids, as run.py's check reads them (e2e_options.read_deploy): a stage without a stage_id
    is its place in the list; HostsUsageError naming the stage and the key where one is not a stage number."""
    stages = doc.get("stages") or []
    if not isinstance(stages, list):
        raise HostsUsageError(f"{where}: stages is {stages!r}, not a list of stages")
    ids = []
    for i, s in enumerate(stages):
        if not isinstance(s, dict):
            raise HostsUsageError(f"{where}: stages[{i}] is {s!r}, not a mapping (stage_id:, ...)")
        try:
            ids.append(stage_id_of(s, i, f"{where}: stages[{i}]"))
        except ValueError as e:
            raise HostsUsageError(str(e)) from None
    return sorted(ids)


def plan(deploy: Path, hosts: int) -> list[str]:
    """The hosts' role names for ``deploy``: ``mooncake``, ``api`` (with stage 0), ``stage1`` ...;
    HostsUsageError naming the count that fits, or the connector that cannot cross hosts."""
    import yaml

    doc = yaml.safe_load(deploy.read_text()) or {}
    if not isinstance(doc, dict):
        raise HostsUsageError(f"{deploy}: a {type(doc).__name__}, not a deploy mapping (stages:, connectors:)")
    ids = stage_ids(doc, deploy)
    if not ids or ids[0] != 0:
        raise HostsUsageError(f"{deploy}: no stage 0 (stage ids {ids})")
    connectors = doc.get("connectors") or {}
    if not isinstance(connectors, dict):
        raise HostsUsageError(f"{deploy}: connectors is a {type(connectors).__name__}; give a mapping of "
                              "NAME: {name: MooncakeStoreConnector, extra: {...}}")  # fmt: skip
    for key, conn in connectors.items():
        if not isinstance(conn, dict):
            names = ", ".join(MOONCAKE_CONNECTORS)
            raise HostsUsageError(f"{deploy}: connectors.{key} is {conn!r}, not a mapping; give "
                                  f"{{name: ..., extra: {{...}}}} (name one of {names})")
        if "extra" in conn and not isinstance(conn["extra"], dict):
            raise HostsUsageError(f"{deploy}: connectors.{key}.extra is {conn['extra']!r}, not a mapping; give the "
                                  "connector's settings (host, master, metadata_server, ...) or leave extra out")
    bad = {k: v.get("name") for k, v in connectors.items() if v.get("name") not in MOONCAKE_CONNECTORS}
    if bad or not connectors:
        what = ", ".join(f"{k} is {n}" for k, n in bad.items()) or "it names no connectors"
        raise HostsUsageError(
            f"{deploy}: stages on separate hosts need Mooncake connectors ({', '.join(MOONCAKE_CONNECTORS)}); "
            f"{what} (use --deploy-config mooncake, configs/qwen3_omni_cpu_mooncake.yaml)"
        )
    want = 1 + len(ids)
    roles = ["mooncake", "api"] + [f"stage{i}" for i in ids[1:]]
    if hosts != want:
        raise HostsUsageError(
            f"--hosts {hosts}: this deploy has stages {', '.join(map(str, ids))}, so it takes --hosts {want} "
            f"({', '.join(roles[:2])} with stage 0, {', '.join(roles[2:]) or 'no other stage'})"
        )
    return roles


def host_deploy(deploy: Path, out: Path, own: str, master: str) -> Path:
    """A copy of ``deploy`` whose Mooncake connectors name ``own`` and the master at ``master``."""
    import yaml

    doc = yaml.safe_load(deploy.read_text())
    for conn in (doc.get("connectors") or {}).values():
        if conn.get("name") in MOONCAKE_CONNECTORS:
            extra = conn.setdefault("extra", {})
            extra["host"] = own
            extra["master"] = f"{master}:{MOONCAKE_RPC_PORT}"
            extra["metadata_server"] = f"http://{master}:{MOONCAKE_HTTP_PORT}/metadata"
    out.write_text(f"# written by run.py --hosts from {deploy}\n" + yaml.safe_dump(doc, sort_keys=False))
    return out


def _connects(addr: str, port: int) -> bool:
    with contextlib.suppress(OSError):
        with socket.create_connection((addr, port), timeout=1):
            return True
    return False


def _metadata_answers(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}?key=omni-accum-probe", timeout=1.0).close()
    except urllib.error.HTTPError:
        return True  # 404 for an unknown key is an answer
    except OSError:
        return False
    return True


FAULTS = ("master-restart[:DOWN_S]", "link-down:ROLE[:SECONDS]")


def parse_fault(text: str, roles: list[str]) -> dict[str, Any]:
    """``master-restart[:DOWN_S]`` or ``link-down:ROLE[:SECONDS]`` -> ``{"kind", "role", "seconds"}``;
    HostsUsageError naming the bad part and the valid choices."""
    kind, *rest = str(text).split(":")
    if kind not in ("master-restart", "link-down"):
        raise HostsUsageError(f"--hosts-fault {text!r}: unknown fault {kind!r} (valid: {', '.join(FAULTS)})")
    role = None
    if kind == "link-down":
        if not rest:
            raise HostsUsageError(f"--hosts-fault {text!r}: which host? (link-down:ROLE[:SECONDS], ROLE one of "
                                  f"{', '.join(roles)})")  # fmt: skip
        if rest[0] not in roles:
            raise HostsUsageError(
                f"--hosts-fault {text!r}: {rest[0]!r} is not a host of this deploy ({', '.join(roles)})"
            )
        role, rest = rest[0], rest[1:]
    if len(rest) > 1:
        raise HostsUsageError(f"--hosts-fault {text!r}: too many parts (valid: {', '.join(FAULTS)})")
    try:
        seconds = float(rest[0]) if rest else 5.0
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 600:
        raise HostsUsageError(f"--hosts-fault {text!r}: {rest[0]!r} is not a number of seconds from 0 to 600")
    return {"kind": kind, "role": role, "seconds": seconds, "spec": str(text)}


class HostsServer:
    """One arm's server across simulated hosts: :meth:`open` (lab + master + head + stages), :meth:`wait_ready`,
    :meth:`processes`, :meth:`stop` (everything, the lab included). Use ``try: ... finally: stop()``."""

    def __init__(self, *, hosts: int, deploy: Path, model: Path, venv_bin: Path, arm_dir: Path,
                 start_timeout: float, grace: float, log=print):  # fmt: skip
        self.roles = plan(deploy, hosts)
        self.deploy, self.model, self.venv_bin, self.arm_dir = deploy, model, venv_bin, arm_dir
        self.start_timeout, self.log = start_timeout, log
        self.lab = netns.NetnsLab(len(self.roles), names=self.roles, grace=grace)
        self.head: netns.Proc | None = None
        self.commands: dict[str, list[str]] = {}
        self.deployment = f"hosts-{secrets.token_hex(6)}"  # OMNI_ACCUM_DEPLOYMENT of every host's processes
        self._stopped = False
        self._master: tuple[netns.Proc, list[str], dict[str, str]] | None = None  # its process, argv, env
        self._gone: set[int] = set()  # processes a fault ended on purpose (not a failed step)
        self._timer: threading.Timer | None = None
        self._hold = threading.Event()  # set by stop(): the fault's thread may end
        self.fault_record: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------ addresses

    @property
    def api(self) -> netns.Host:
        return self.lab.host("api")

    @property
    def base(self) -> str:
        return f"http://{self.api.addr}:{API_PORT}"

    @property
    def addresses(self) -> list[str]:
        return [h.addr for h in self.lab.hosts] + ([self.lab.driver_addr] if self.lab.driver_addr else [])

    def describe(self) -> dict[str, Any]:
        return {
            "prefix": self.lab.prefix,
            "subnet": str(self.lab.subnet),
            "driver": self.lab.driver_addr,
            "hosts": [{"role": h.name, "namespace": h.ns, "addr": h.addr} for h in self.lab.hosts],
            "commands": self.commands,
            "omni_accum_deployment": self.deployment,
        }

    # ------------------------------------------------------------------------------------------ start

    def open(self) -> HostsServer:
        """Make the lab (namespaces, bridge, addresses); nothing is started yet."""
        self.lab.__enter__()
        self.log(f"hosts: lab {self.lab.prefix} on {self.lab.subnet}: " + ", ".join(
            f"{h.name} {h.addr}" for h in self.lab.hosts) + f"; the harness at {self.lab.driver_addr}")  # fmt: skip
        return self

    def start(self, env: dict[str, str]) -> netns.Proc:
        """mooncake_master, then the head, then each headless stage; returns the head's process."""
        self.start_master(env)
        mc = self.lab.host("mooncake")
        serve = [str(self.venv_bin / "vllm-omni"), "serve", str(self.model), "--omni"]
        api = self.api
        head = [
            *serve, "--host", api.addr, "--port", str(API_PORT),
            "--deploy-config", str(self._deploy_for(api, mc)),
            "--stage-init-timeout", str(math.ceil(self.start_timeout)),  # 0.5 s: 1 (int() made it 0)
            "--stage-id", "0", "--omni-master-address", api.addr, "--omni-master-port", str(OMNI_MASTER_PORT),
        ]  # fmt: skip
        self.head = self._spawn(api, head, "api", env)
        # the stages register with the head's master server: start them once it listens
        self._wait(lambda: _connects(api.addr, OMNI_MASTER_PORT), self.start_timeout, "the head's OmniMasterServer")
        for h in self.lab.hosts[2:]:
            stage = int(h.name.removeprefix("stage"))
            cmd = [
                *serve, "--headless", "--stage-id", str(stage),
                "--omni-master-address", api.addr, "--omni-master-port", str(OMNI_MASTER_PORT),
                "--omni-replica-address", h.addr,
                "--deploy-config", str(self._deploy_for(h, mc)),
            ]  # fmt: skip
            self._spawn(h, cmd, h.name, env)
        return self.head

    def start_master(self, env: dict[str, str]) -> netns.Proc:
        """``mooncake_master`` on host ``mooncake``, waited for (60 s)."""
        mc = self.lab.host("mooncake")
        py = str(self.venv_bin / "python")
        r = subprocess.run([py, "-c", MASTER_BINARY], capture_output=True, text=True, check=True)
        master = [
            r.stdout.strip(),
            f"--rpc_address={mc.addr}",
            f"--rpc_port={MOONCAKE_RPC_PORT}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={mc.addr}",
            f"--http_metadata_server_port={MOONCAKE_HTTP_PORT}",
            f"--metrics_host={mc.addr}",
            f"--metrics_port={MOONCAKE_METRICS_PORT}",
        ]
        mproc = self._spawn(mc, master, "mooncake-master", env)
        self._master = (mproc, master, env)
        self._wait_master(60)
        self.log(f"hosts: mooncake_master answers on {mc.addr}:{MOONCAKE_RPC_PORT} (pid {mproc.popen.pid})")
        return mproc

    def _wait_master(self, timeout: float) -> None:
        mc = self.lab.host("mooncake")
        metadata = f"http://{mc.addr}:{MOONCAKE_HTTP_PORT}/metadata"
        answers = lambda: _metadata_answers(metadata) and _connects(mc.addr, MOONCAKE_RPC_PORT)  # noqa: E731
        self._wait(answers, timeout, "mooncake_master")

    # ------------------------------------------------------------------------------------------ faults

    def arm_fault(self, fault: dict[str, Any], after_s: float) -> None:
        """:meth:`inject` ``fault`` (``parse_fault``'s) ``after_s`` seconds from now, once."""
        if self._timer is None:
            self.fault_record = {**fault, "after_s": after_s, "done": False}
            self._timer = threading.Timer(after_s, self._inject_quietly, args=(fault,))
            self._timer.daemon = True
            self._timer.start()

    def cancel_fault(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _inject_quietly(self, fault: dict[str, Any]) -> None:
        try:
            self.inject(fault)
        except Exception as e:  # noqa: BLE001 - recorded: the arm's report says the fault could not be made
            self.fault_record["error"] = f"{type(e).__name__}: {e}"
            self.log(f"hosts: fault {fault['spec']} failed: {self.fault_record['error']}")
        # A process started here (the fresh master) gets SIGTERM when the *thread* that forked it ends
        # (PR_SET_PDEATHSIG, netns.spawn's guard against a killed harness): this thread lives until stop().
        self._hold.wait()

    def inject(self, fault: dict[str, Any]) -> dict[str, Any]:
        """Make ``fault`` now (blocks for its duration); the record also goes to :attr:`fault_record`."""
        rec = self.fault_record = {**self.fault_record, **fault, "done": False}
        rec["log_offsets"] = {p.name: _size(p.log) for p in self.lab.procs if p.log}
        rec["t0_wall"] = time.time()
        t0 = time.monotonic()
        if fault["kind"] == "master-restart":
            if self._master is None:
                raise netns.StepFailed("no mooncake_master to restart")
            old, argv, env = self._master
            self._gone.add(old.popen.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(old.popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                old.popen.wait(timeout=10)
            rec["killed_pid"] = old.popen.pid
            self.log(f"hosts: fault: SIGKILL mooncake_master (pid {old.popen.pid}); "
                     f"a fresh one in {fault['seconds']} s")
            time.sleep(fault["seconds"])
            mc = self.lab.host("mooncake")
            n = sum(p.name.startswith("mooncake-master") for p in self.lab.procs) + 1
            new = self._spawn(mc, argv, f"mooncake-master-{n}", env)
            self._master = (new, argv, env)
            self._wait_master(60)
            rec["new_pid"] = new.popen.pid
            rec["master_answers_after_s"] = round(time.monotonic() - t0, 2)
            self.log(f"hosts: fault: the fresh mooncake_master answers (pid {new.popen.pid}) "
                     f"{rec['master_answers_after_s']} s after the kill")  # fmt: skip
        else:
            h = self.lab.host(fault["role"])
            netns.ip("-n", h.ns, "link", "set", "dev", h.link, "down")
            self.log(f"hosts: fault: link {h.link} of {h.name} ({h.addr}) down for {fault['seconds']} s")
            try:
                time.sleep(fault["seconds"])
            finally:
                netns.ip("-n", h.ns, "link", "set", "dev", h.link, "up")
            rec["link"] = h.link
            self.log(f"hosts: fault: link {h.link} of {h.name} up again")
        rec["took_s"] = round(time.monotonic() - t0, 2)
        rec["done"] = True
        return rec

    def fault_report(self, bench: list[dict[str, Any]] | None) -> dict[str, Any]:
        """What the servers did after the fault: ``/health``, the processes per host (the head's, the stages',
        a master's restart), the client's answered and failed requests, and each host's log lines after it that
        name an error, a time-out, a death or a restart (at most 20 per host)."""
        out = dict(self.fault_record)
        offsets = out.pop("log_offsets", {})
        if not out.get("done"):
            return out
        with contextlib.suppress(Exception):
            out["health"] = http_json("GET", self.base + "/health", timeout=10)[0]
        out.setdefault("health", None)
        out["running"] = {p.name: p.popen.poll() is None for p in self.lab.procs}
        if bench is not None:
            out["client"] = client_errors(bench)
        got = {p.name: event_lines(p.log, offsets.get(p.name, 0), 20) for p in self.lab.procs}
        out["log_lines"] = {name: lines for name, lines in got.items() if lines}
        return out

    def _deploy_for(self, host: netns.Host, mc: netns.Host) -> Path:
        return host_deploy(self.deploy, self.arm_dir / f"deploy-{host.name}.yaml", host.addr, mc.addr)

    def _spawn(self, host: netns.Host, argv: list[str], name: str, env: dict[str, str]) -> netns.Proc:
        # one server, one deployment token (the hellos' keys), a fresh one per arm (a new server)
        env = {**env, "MC_TCP_BIND_ADDRESS": host.addr, "VLLM_HOST_IP": host.addr,
               "OMNI_ACCUM_DEPLOYMENT": self.deployment}  # fmt: skip
        self.commands[name] = [f"ip netns exec {host.ns}", *argv]
        log = self.arm_dir / f"{name}.log"
        self.log(f"hosts: [{name} @ {host.addr}] {' '.join(argv)} (log {log})")
        return self.lab.spawn(host, argv, name=name, log=log, env=env)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for p in self.lab.procs:
                if p.popen.pid not in self._gone:  # a master a fault killed is not a failed step
                    self.lab.expect_running(p, f"{p.name} (waiting for {what})")
            if time.monotonic() > deadline:
                raise netns.StepFailed(f"{what} not ready after {timeout:.0f} s")
            time.sleep(0.5)

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ``/health`` and ``/v1/models`` answer; StepFailed when any host's process exits first."""
        t0 = time.monotonic()

        def ready() -> bool:
            with contextlib.suppress(OSError, ValueError):
                code, _ = http_json("GET", self.base + "/health", timeout=5)
                if code == 200:
                    return http_json("GET", self.base + "/v1/models", timeout=10)[0] == 200
            return False

        self._wait(ready, timeout, "the API server")
        return time.monotonic() - t0

    # ------------------------------------------------------------------------------------------ processes

    def processes(self) -> list[dict[str, Any]]:
        """Every live process inside the lab's namespaces (``/proc`` listing, as ``server_processes``), each
        with the role of its host (``host``)."""
        out = []
        for h in self.lab.hosts:
            for pid in self.lab.pids_in(h.ns):
                info = proc_info(pid)
                if info is not None and info["state"] != "Z":
                    out.append({**info, "host": h.name})
        return sorted(out, key=lambda i: i["pid"])

    def stop(self, known: list[dict[str, Any]]) -> dict[str, Any]:
        """Stop every process and remove the lab; the same report keys as ``e2e_procs.stop_server``."""
        if self._stopped:
            return {"clean": True, "note": "already stopped"}
        self._stopped = True
        self.cancel_fault()
        # NetnsLab.close stops the newest first: the stages, then the head, then the master(s), whenever started
        masters = [p for p in self.lab.procs if p.name.startswith("mooncake-master")]
        self.lab.procs[:] = masters + [p for p in self.lab.procs if p not in masters]
        exits = {}
        left = self.lab.close(raise_on_leftovers=False)
        self._hold.set()
        for p in self.lab.procs:
            exits[p.name] = p.popen.returncode
        still = [i for i in known if alive(i)]  # the very process (pid and start time), not a zombie
        report = {
            "signals": [f"SIGTERM each process group (stages, head, master), SIGKILL after {self.lab.grace:.0f} s; "
                        "then the namespaces"],
            "exit_status": exits.get("api"),
            "exit_statuses": exits,
            "left_running": [{"pid": i["pid"], "title": i["title"][:80]} for i in still],
            "port_free": True,  # the ports lived in the namespaces, which are gone
            "netns_left": left,
        }
        report["clean"] = not still and not any(v for v in left.values())
        return report


def _size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - a manual check of the prerequisites
    why = prerequisites(sys.executable)
    print(why or "hosts mode: prerequisites met")
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
