"""Simulated hosts on one machine: Linux network namespaces joined by a bridge, with addresses of their own.

    with NetnsLab(4) as lab:                          # root only; NetnsUnavailable says why not
        mc, api, s1, s2 = lab.hosts                   # Host(name, ns, addr)
        lab.spawn(mc, ["mooncake_master", ...], name="mooncake-master", log=path)
        lab.run(api, ["python", "-c", "..."], step="probe")   # StepFailed when it exits non-zero
    # every process, link and namespace it made is gone here, also after an exception or SIGTERM

What it makes, all named with one unique prefix ``oan<pid, 6 hex><2 random hex>`` (``oan0012ab7f``):

* a *switch* namespace ``PREFIX-sw`` holding a bridge ``PREFIXbr``;
* per host a namespace ``PREFIX-hI`` with one veth end ``PREFIXhI`` (address ``10.231.X.(10+I)/24``, up, and
  its own loopback up) whose peer ``PREFIXsI`` is a port of the bridge in the switch namespace;
* with ``driver=True`` (the default) a veth ``PREFIXd`` in the calling (root) namespace, address
  ``10.231.X.1/24``, whose peer is a bridge port: the harness itself (HTTP probes, the benchmark client)
  reaches the hosts' addresses, and they reach it. This adds the route ``10.231.X.0/24`` to the root
  namespace, so ``X`` is chosen so that the /24 overlaps no route nor address already there, nor any single
  address the host talks to or is told of (gateways, neighbours, socket peers, name servers, ``/etc/hosts``):
  a real 10.231.X.0/24 reached through the default gateway would be cut off by the lab's more specific route.
  Labs choose and make their route holding a lock (``/run/omni-accum-netns.lock``), so two starting at once
  never choose the same X.

Every namespace and root-namespace link is recorded before it is made, so a teardown after any step removes it.

Processes started with :meth:`NetnsLab.spawn` run under ``ip netns exec NS ...`` (which execs: the pid is
the command's) in a process group of their own, with ``PR_SET_PDEATHSIG`` (SIGTERM) so a killed harness
does not leave them running. Teardown, in reverse order of creation and whatever happened before:

1. each spawned process group: SIGTERM, ``grace`` seconds, SIGKILL;
2. every process still inside one of the lab's namespaces (``ip netns pids``: also those that left their
   group with ``setsid``): SIGKILL, waited for;
3. the root-side veth, then the host namespaces, then the switch namespace (their links go with them);
4. a check that no namespace, root-namespace link, route or process of the lab remains
   (:attr:`NetnsLab.leftovers`; :class:`NetnsCleanupError` when something does and no other error is
   already on its way).

SIGTERM and SIGHUP become :class:`Interrupted` (a ``KeyboardInterrupt``, so a caller's Ctrl-C handling, such as
run.py writing the finished arms' results and exiting 130, applies to them too) while the lab is open (main thread
only), so ``with`` blocks unwind and clean up; during teardown SIGINT/SIGTERM/SIGHUP are ignored, so a
second Ctrl-C does not cut it short. A harness killed with SIGKILL cannot clean up: ``python netns.py
--sweep`` removes the namespaces (and processes in them) of labs whose creating process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

PREFIX_RE = re.compile(r"^oan([0-9a-f]{6})([0-9a-f]{2})")
NETNS_DIR = Path("/run/netns")
SUBNET_BASE = "10.231"  # private (RFC 1918); the third octet is chosen per lab
HOST_OFFSET = 10  # host I gets .(10 + I); the driver (root side) gets .1
MAX_HOSTS = 16

try:  # resolved at import, not between fork and exec
    _LIBC: Any = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here: not root, no ``ip``, or the kernel / container refuses."""


class StepFailed(RuntimeError):
    """A step inside the lab failed (a command exited non-zero, a process died early)."""


class NetnsCleanupError(RuntimeError):
    """Teardown left something of the lab behind (listed in the message and in ``lab.leftovers``)."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM / SIGHUP while a lab was open (raised in the main thread so ``with`` blocks clean up). A
    ``KeyboardInterrupt``: whatever handles Ctrl-C handles these signals the same way."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass(frozen=True)
class Host:
    index: int
    name: str  # a role name given by the caller, e.g. "mooncake", "api", "stage1"
    ns: str  # the namespace
    addr: str  # its address (no prefix length)
    link: str  # its veth end inside the namespace


@dataclass
class Proc:
    name: str
    host: Host
    popen: subprocess.Popen
    argv: list[str]
    log: str | None = None


def _ip_path() -> str | None:
    found = shutil.which("ip")
    return found or next((p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip") if os.access(p, os.X_OK)), None)


def ip(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run ``ip ARGS``; with ``check`` a non-zero exit raises RuntimeError naming the command and its stderr."""
    binary = _ip_path()
    if binary is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed: apt-get install iproute2")
    r = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def problem() -> str | None:
    """Why network namespaces cannot be made here, or None. Tries a real ``ip netns add`` / ``del``."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this process runs as uid {os.geteuid()})"
    if _ip_path() is None:
        return "the `ip` command (iproute2) is not installed: apt-get install iproute2"
    probe = f"{new_prefix()}-probe"
    r = ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` is not permitted here: {r.stderr.strip() or r.returncode}"
    r = ip("-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1", check=False)
    ip("netns", "del", probe, check=False)
    if r.returncode != 0:
        return f"veth pairs cannot be made here: {r.stderr.strip() or r.returncode}"
    return None


def ensure_ip_command(install: bool = True) -> str | None:
    """None when ``ip`` is there (or was just installed with apt-get, as root); else what is missing."""
    if _ip_path() is not None:
        return None
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        print("[netns] `ip` missing: apt-get install -y --no-install-recommends iproute2", file=sys.stderr)
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "iproute2"], check=False)
        if _ip_path() is not None:
            return None
    return "the `ip` command (iproute2) is not installed: apt-get install iproute2"


def new_prefix() -> str:
    return f"oan{os.getpid() & 0xFFFFFF:06x}{secrets.randbelow(256):02x}"


def root_networks() -> list[ipaddress.IPv4Network]:
    """What the root namespace knows of IPv4: the destinations of its routes (all tables), its addresses, and the
    single addresses it talks to or is told of: default gateways, neighbours (``ip neigh``), the peers of its open
    TCP and UDP sockets, its name servers (``/etc/resolv.conf``) and ``/etc/hosts``. A real ``10.231.X.0/24``
    reached through the default gateway is not in the routing table, but a host that uses it talks to it: the lab's
    more specific route would cut that off, so such an X is not picked."""
    nets: list[ipaddress.IPv4Network] = []
    kinds = {"local", "broadcast", "unicast", "multicast", "unreachable", "blackhole", "prohibit", "throw", "anycast"}
    for line in ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        toks = line.split()
        if toks and toks[0] in kinds:
            toks = toks[1:]
        if toks and "via" in toks[:-1]:  # the gateway itself (of a default route too)
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.ip_network(toks[toks.index("via") + 1]))
        if not toks or toks[0] == "default":
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(toks[0], strict=False))
    for line in ip("-4", "-o", "addr", "show", check=False).stdout.splitlines():
        m = re.search(r"\binet (\S+)", line)
        if m:
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.ip_interface(m.group(1)).network)
    singles = [line.split()[0] for line in ip("-4", "neigh", "show", check=False).stdout.splitlines() if line.strip()]
    singles += socket_peers()
    for line in _read("/etc/resolv.conf").splitlines():
        toks = line.split()
        if len(toks) >= 2 and toks[0] == "nameserver":
            singles.append(toks[1])
    for line in _read("/etc/hosts").splitlines():
        toks = line.split("#")[0].split()
        if toks:
            singles.append(toks[0])
    for addr in singles:
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(addr))  # an IPv6 one is skipped by the overlap check
    return nets


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def socket_peers() -> list[str]:
    """The IPv4 remote addresses of the root namespace's TCP and UDP sockets (``/proc/net/{tcp,udp}``)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/udp"):
        for line in _read(table).splitlines()[1:]:
            toks = line.split()
            if len(toks) > 2 and ":" in toks[2]:
                with contextlib.suppress(ValueError):
                    n = int(toks[2].split(":")[0], 16)
                    if n:
                        out.append(str(ipaddress.IPv4Address(n.to_bytes(4, "little"))))
    return out


#: Held (``flock``) while a lab chooses its subnet and makes its route, so two labs starting at once never choose the
#: same one. Root's own: refused when it is not a regular file owned by root.
LOCK_PATH = Path("/run/omni-accum-netns.lock")
LOCK_WAIT_S = 120.0


@contextlib.contextmanager
def subnet_lock(path: Path | None = None, wait_s: float | None = None):
    """Hold :data:`LOCK_PATH` exclusively (NetnsUnavailable naming it when it is not root's plain file, or when another
    lab held it for ``wait_s`` seconds)."""
    import fcntl

    path = LOCK_PATH if path is None else path
    wait_s = LOCK_WAIT_S if wait_s is None else wait_s
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise NetnsUnavailable(f"the subnet lock {path}: {e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise NetnsUnavailable(f"the subnet lock {path} is not a regular file of root's, writable by root only: "
                                   "remove it (the next lab makes it again)")  # fmt: skip
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NetnsUnavailable(f"the subnet lock {path}: another lab held it for {wait_s:.0f} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def pick_subnet(start: int | None = None) -> ipaddress.IPv4Network:
    """A ``10.231.X.0/24`` that overlaps nothing the root namespace knows (:func:`root_networks`; other labs'
    routes included: call it holding :func:`subnet_lock` until the lab's route exists)."""
    taken = root_networks()
    first = secrets.randbelow(256) if start is None else start
    for k in range(256):
        net = ipaddress.ip_network(f"{SUBNET_BASE}.{(first + k) % 256}.0/24")
        if not any(net.overlaps(t) for t in taken if t.version == 4):
            return net
    raise NetnsUnavailable(f"every {SUBNET_BASE}.X.0/24 overlaps a route or address here (`ip route`)")


def _net_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _proc_net_inodes() -> dict[int, int]:
    """pid -> inode of its network namespace, for every readable live process."""
    out: dict[int, int] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                link = os.readlink(f"/proc/{p}/ns/net")  # "net:[4026532281]"
            except OSError:
                continue
            with contextlib.suppress(ValueError):
                out[int(p)] = int(link[5:-1])
    return out


def _pdeathsig() -> None:
    if _LIBC is not None:
        _LIBC.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG: a killed harness takes its children along


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _tail(path: str | None, n: int = 2000) -> str:
    if not path:
        return ""
    with contextlib.suppress(OSError):
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    return ""


@dataclass
class NetnsLab:
    """``n`` simulated hosts (network namespaces on one bridge); see the module docstring."""

    n: int
    names: Sequence[str] | None = None  # role names of the hosts (default h0, h1, ...)
    driver: bool = True
    prefix: str = field(default_factory=new_prefix)
    grace: float = 20.0  # seconds between SIGTERM and SIGKILL per process group
    subnet: ipaddress.IPv4Network | None = None
    hosts: list[Host] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    leftovers: dict[str, list] = field(default_factory=dict)
    _namespaces: list[str] = field(default_factory=list, repr=False)  # in creation order
    _ns_inodes: dict[str, int] = field(default_factory=dict, repr=False)
    _root_links: list[str] = field(default_factory=list, repr=False)
    _old_handlers: dict[int, Any] = field(default_factory=dict, repr=False)
    _log_files: list[Any] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.n <= MAX_HOSTS:
            raise ValueError(f"hosts: {self.n} is out of range (1 to {MAX_HOSTS})")
        if self.names is not None and len(self.names) != self.n:
            raise ValueError(f"names: {len(self.names)} names for {self.n} hosts")
        if not PREFIX_RE.match(self.prefix) or len(self.prefix) != 11:
            raise ValueError(f"prefix {self.prefix!r}: must be oan + 8 hex digits (new_prefix())")

    # ------------------------------------------------------------------------------------------ set-up

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def driver_addr(self) -> str | None:
        return str(self.subnet.network_address + 1) if self.driver and self.subnet else None

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    def __enter__(self) -> NetnsLab:
        why = problem()
        if why:
            raise NetnsUnavailable(why)
        self._install_signal_handlers()
        try:
            self._create()
        except BaseException:
            self.close(raise_on_leftovers=False)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(raise_on_leftovers=exc_type is None)

    def _add_ns(self, name: str) -> None:
        self._namespaces.append(name)  # first: a teardown after the add (a signal, an error) removes it
        ip("netns", "add", name)
        ino = _net_inode(str(NETNS_DIR / name))
        if ino is not None:
            self._ns_inodes[name] = ino
        ip("-n", name, "link", "set", "lo", "up")

    def _create(self) -> None:
        with subnet_lock():  # until the route into the chosen subnet exists (the driver's address): no other lab
            self._create_locked()  # starting at once chooses the same subnet

    def _create_locked(self) -> None:
        if self.subnet is None:
            self.subnet = pick_subnet()
        p, sw = self.prefix, self.switch_ns
        self._add_ns(sw)
        ip("-n", sw, "link", "add", f"{p}br", "type", "bridge")
        ip("-n", sw, "link", "set", f"{p}br", "up")
        names = list(self.names) if self.names is not None else [f"h{i}" for i in range(self.n)]
        for i, role in enumerate(names):
            ns, inner, outer = f"{p}-h{i}", f"{p}h{i}", f"{p}s{i}"
            addr = str(self.subnet.network_address + HOST_OFFSET + i)
            self._add_ns(ns)
            ip("-n", sw, "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
            ip("-n", sw, "link", "set", outer, "master", f"{p}br", "up")
            ip("-n", ns, "addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
            self.hosts.append(Host(i, role, ns, addr, inner))
        if self.driver:
            self._root_links.append(f"{p}d")
            ip("link", "add", f"{p}d", "type", "veth", "peer", "name", f"{p}ds", "netns", sw)
            ip("-n", sw, "link", "set", f"{p}ds", "master", f"{p}br", "up")
            ip("addr", "add", f"{self.driver_addr}/{self.subnet.prefixlen}", "dev", f"{p}d")
            ip("link", "set", f"{p}d", "up")

    # ------------------------------------------------------------------------------------------ processes

    def spawn(
        self,
        host: Host,
        argv: Sequence[str],
        *,
        name: str | None = None,
        log: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> Proc:
        """Start ``argv`` inside ``host``'s namespace, in a process group of its own; output to ``log``."""
        out: Any = subprocess.DEVNULL
        if log is not None:
            out = open(log, "ab")  # noqa: SIM115 - closed at teardown
            self._log_files.append(out)
        full = [_ip_path() or "ip", "netns", "exec", host.ns, *map(str, argv)]
        popen = subprocess.Popen(
            full,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_pdeathsig,
        )
        proc = Proc(name or Path(str(argv[0])).name, host, popen, list(map(str, argv)), str(log) if log else None)
        self.procs.append(proc)
        return proc

    def run(
        self,
        host: Host,
        argv: Sequence[str],
        *,
        step: str | None = None,
        timeout: float = 120,
        env: dict[str, str] | None = None,
        check: bool = True,
        input: bytes | None = None,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` to completion inside ``host``; with ``check``, StepFailed when it exits non-zero."""
        what = step or " ".join(map(str, argv))[:80]
        full = [_ip_path() or "ip", "netns", "exec", host.ns, *map(str, argv)]
        # Its own session, stopped with the lab's processes if the lab closes while it runs.
        popen = subprocess.Popen(
            full, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            start_new_session=True, preexec_fn=_pdeathsig,
        )  # fmt: skip
        proc = Proc(f"run:{what}", host, popen, list(map(str, argv)))
        self.procs.append(proc)
        try:
            out, err = popen.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            self._stop_group(proc, grace=2)
            raise StepFailed(f"step {what!r} on {host.name} ({host.addr}): no exit after {timeout:.0f} s") from None
        finally:
            with contextlib.suppress(ValueError):
                self.procs.remove(proc)
        r = subprocess.CompletedProcess(argv, popen.returncode, out, err)
        if check and r.returncode != 0:
            tail = (err or out or b"").decode(errors="replace").strip()[-800:]
            raise StepFailed(f"step {what!r} on {host.name} ({host.addr}) exited with {r.returncode}: {tail}")
        return r

    def expect_running(self, proc: Proc, step: str | None = None) -> None:
        """StepFailed when ``proc`` has exited (its log's tail in the message)."""
        rc = proc.popen.poll()
        if rc is not None:
            raise StepFailed(
                f"{step or proc.name} on {proc.host.name} ({proc.host.addr}) exited with {rc}"
                + (f"; log {proc.log}:\n{_tail(proc.log)}" if proc.log else "")
            )

    def pids_in(self, ns: str) -> list[int]:
        """Processes inside namespace ``ns`` (``ip netns pids``)."""
        r = ip("netns", "pids", ns, check=False)
        return [int(t) for t in r.stdout.split() if t.isdigit()]

    def _stop_group(self, proc: Proc, grace: float) -> None:
        pgid = proc.popen.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None and not self._group_alive(pgid):
                break
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=10)

    @staticmethod
    def _group_alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    # ------------------------------------------------------------------------------------------ teardown

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):  # noqa: ARG001
            raise Interrupted(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _quiet_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def close(self, raise_on_leftovers: bool = True) -> dict[str, list]:
        """Tear everything down (idempotent); returns what is left (empty lists when clean)."""
        quiet = self._quiet_signals()
        errors: list[str] = []
        try:
            # 1. the spawned process groups, newest first
            for proc in reversed(self.procs):
                try:
                    self._stop_group(proc, self.grace)
                except Exception as e:  # noqa: BLE001 - keep tearing down
                    errors.append(f"stopping {proc.name}: {e}")
            # 2. anything else inside the lab's namespaces (left its group, or started by a child)
            for _ in range(50):
                pids = [pid for ns in self._namespaces for pid in self.pids_in(ns) if pid != os.getpid()]
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                for proc in self.procs:
                    proc.popen.poll()  # reap ours
                time.sleep(0.1)
            # 3. links in the root namespace, then the namespaces (hosts before the switch)
            for link in reversed(self._root_links):
                if ip("link", "show", link, check=False).returncode == 0:
                    r = ip("link", "del", link, check=False)
                    if r.returncode != 0:
                        errors.append(f"ip link del {link}: {r.stderr.strip()}")
            for ns in reversed(self._namespaces):
                if (NETNS_DIR / ns).exists():
                    r = ip("netns", "del", ns, check=False)
                    if r.returncode != 0:
                        errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
            for f in self._log_files:
                with contextlib.suppress(OSError):
                    f.close()
            self._log_files.clear()
            self.leftovers = self.check_clean()
            if errors:
                self.leftovers["errors"] = errors
        finally:
            for sig, old in {**quiet, **self._old_handlers}.items():
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(sig, old)
            self._old_handlers.clear()
        bad = {k: v for k, v in self.leftovers.items() if v}
        if bad:
            msg = f"netns lab {self.prefix} left behind: {bad}"
            if raise_on_leftovers:
                raise NetnsCleanupError(msg)
            print(f"[netns] {msg}", file=sys.stderr)
        return self.leftovers

    def check_clean(self) -> dict[str, list]:
        """What of this lab still exists: namespaces, root-namespace links, routes, processes."""
        return leftovers(self.prefix, [p.popen.pid for p in self.procs], self._ns_inodes.values(), self.subnet)


def leftovers(
    prefix: str,
    pids: Sequence[int] = (),
    ns_inodes: Any = (),
    subnet: ipaddress.IPv4Network | None = None,
) -> dict[str, list]:
    """Namespaces and root links named ``prefix*``, the ``pids`` still alive, processes inside a namespace
    whose inode is in ``ns_inodes``, and root routes into ``subnet``."""
    out: dict[str, list] = {}
    out["namespaces"] = [n for n in list_namespaces() if n.startswith(prefix)]
    out["links"] = [n for n in root_links() if n.startswith(prefix)]
    inodes = set(ns_inodes)
    in_ns = [pid for pid, ino in _proc_net_inodes().items() if ino in inodes] if inodes else []
    out["processes"] = sorted({p for p in pids if _alive(p)} | {p for p in in_ns if _alive(p)})
    out["routes"] = (
        [n for n in ip("-4", "route", "show", check=False).stdout.splitlines() if n.startswith(str(subnet))]
        if subnet is not None
        else []
    )
    return out


def list_namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list", check=False).stdout.splitlines() if line.strip()]


def root_links() -> list[str]:
    names = []
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(r"\d+:\s+([^:@\s]+)", line)
        if m:
            names.append(m.group(1))
    return names


def sweep(dry_run: bool = False) -> list[str]:
    """Remove the namespaces (SIGKILL the processes in them first) and root links of labs whose creating
    process is gone; returns their names. A live lab's are never touched."""
    removed: list[str] = []
    for ns in list_namespaces():
        m = PREFIX_RE.match(ns)
        if not m or _alive(int(m.group(1), 16)):
            continue
        removed.append(ns)
        if dry_run:
            continue
        for pid in [int(t) for t in ip("netns", "pids", ns, check=False).stdout.split() if t.isdigit()]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    for link in root_links():
        m = PREFIX_RE.match(link)
        if m and not _alive(int(m.group(1), 16)):
            removed.append(link)
            if not dry_run:
                ip("link", "del", link, check=False)
    if not dry_run:
        time.sleep(0.2)
        for ns in [r for r in removed if r in set(list_namespaces())]:
            ip("netns", "del", ns, check=False)
    return removed


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Network-namespace labs of the e2e harness (run.py --hosts).")
    ap.add_argument("--sweep", action="store_true", help="remove what labs of dead processes left behind")
    ap.add_argument("--dry-run", action="store_true", help="with --sweep: list, remove nothing")
    ap.add_argument("--check", action="store_true", help="say whether network namespaces can be made here")
    args = ap.parse_args(argv)
    if args.check or not args.sweep:
        why = problem()
        print(why or "network namespaces: available")
        return 1 if why else 0
    if os.geteuid() != 0:
        print(f"--sweep needs root (uid {os.geteuid()})", file=sys.stderr)
        return 2
    for name in sweep(dry_run=args.dry_run):
        print(("would remove " if args.dry_run else "removed ") + name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
