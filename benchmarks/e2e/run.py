"""End-to-end harness: a real three-stage Qwen3-Omni vllm-omni server on CPU, arm by arm.

    bash benchmarks/e2e/setup_env.sh
    benchmarks/e2e/.work/venv/bin/python benchmarks/e2e/build_model.py
    benchmarks/e2e/.work/venv/bin/python benchmarks/e2e/run.py --smoke
    benchmarks/e2e/.work/venv/bin/python benchmarks/e2e/run.py --arms off,default,qwen3-omni \\
        --input-len 8000 --output-len 100 --concurrency 1 --json out/e2e.json
    benchmarks/e2e/.work/venv/bin/python benchmarks/e2e/build_model.py --variant light
    benchmarks/e2e/.work/venv/bin/python benchmarks/e2e/run.py --model light --input-len 8000,32000 \\
        --arms off,default,qwen3-omni,qwen3-omni@arena

For each arm (``off``: ``OMNI_ACCUM_VLLM_OMNI=0``; ``default`` / ``qwen3-omni`` / any policy file:
``OMNI_ACCUM_POLICY=<arm>``) it starts ``vllm-omni serve`` on 127.0.0.1 (a free port, its own
process group), waits for readiness, sends two temperature-0 chat requests with audio output
(the correctness probes, on the fresh server), runs vLLM's benchmark client (``vllm bench serve
--omni``, random dataset) once per input length and concurrency, lists the server's processes,
reads omni-accum's per-process status files (``OMNI_ACCUM_STATUS_DIR``, a fresh folder per arm)
and its log lines, scrapes ``/metrics`` (``PROMETHEUS_MULTIPROC_DIR``, a fresh folder per arm, so
the stage processes' counters are there) for what omni-accum counted (chunks, wire bytes, bytes
kept off the wire, fallbacks, and per benchmark the hand-off between stages and the stage
processor's accumulation), stops the server by process group and checks nothing is left (no
process, port free). Then it prints one table per input length and concurrency (E2EL, TTFT, TPOT,
ITL p50/p99, audio TTFP, audio RTF per arm, ratio to ``off``; the server's hand-off and processor
accumulation times and the hand-off's share of audio TTFP), compares the correctness outputs
(``default`` must equal ``off`` byte for byte) and writes ``--json``.

Only one server runs at a time. Exit status: 0 when every arm started, answered with text and
audio, and was cleaned up, and ``default`` equals ``off`` when both ran; 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the harness's own modules next to this script

from e2e_procs import (  # noqa: E402
    alive, chat_with_audio, coverage, free_port, print_coverage, proc_info, read_status_dir, role_of, scan_log,
    server_processes, shm_cleanup, shm_entries, stop_server, wait_ready,
)  # fmt: skip
from e2e_report import (  # noqa: E402
    compare, metrics_delta, payload_memcpy_ms, print_metrics, print_table, scrape_metrics, stage_requests, stage_rows,
)  # fmt: skip
from e2e_watch import (  # noqa: E402 - memory samples, a stage killed on purpose, omni-accum's leftovers
    Sampler, StageKiller, bench_errors, client_errors, fallbacks_delta, fault_report, health_status, omni_accum_left,
    stage_number,
)  # fmt: skip

import hosts as hosts_mode  # noqa: E402 - run.py --hosts N (network namespaces, netns.py)

WORK = HERE / ".work"
MODELS = {"tiny": WORK / "model", "light": WORK / "model-light", "lean": WORK / "model-lean"}  # --variant NAME
DEFAULT_MODEL = "tiny"
VENV_BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Release:
    """One vllm-omni release's server environment (``setup_env.sh --release NAME``)."""

    name: str
    venv: Path  # setup_env.sh's default folder for it
    models: dict  # build_model.py --variant NAME's folders, built by this release's transformers
    configs: Path  # the deploy / stage configs: qwen3_omni_cpu.yaml and qwen3_omni_cpu_NAME.yaml
    config_flag: str  # how `vllm-omni serve` takes it
    # the benchmark client's command (`X bench serve --omni`): vllm-omni 0.30.0 adds --omni to vLLM's own `vllm`;
    # 0.16.0 has it only in its `vllm-omni` CLI (vLLM 0.16.0's `vllm bench serve` has no openai-chat-omni backend)
    bench_cli: str = "vllm"
    # put first on the benchmark client's PYTHONPATH (0.16: client_016/sitecustomize.py, pydub's WAV reader for
    # the audio chunks in place of the ffmpeg this host lacks)
    client_path: Path | None = None
    # the benchmark client's niceness (0: as this script). 0.16.0's three stage workers poll on every core (load
    # 15-17 on 2 cores while idle) and the client then got ~0.5 % of a core: 8 s of CPU in its first 15+ minutes,
    # still importing, no request sent. Negative needs root; without it `nice` says so and runs the client as is.
    client_nice: int = 0
    # added to `vllm-omni serve`. 0.16: --log-stats, the orchestrator's per-request stage tables (each stage's
    # wall time and tokens: the talker's time per token, which neither the client nor 0.16.0's Prometheus
    # metrics tell apart, as every stage there reports as engine "0")
    server_flags: tuple[str, ...] = ()
    # the server session's autogroup niceness (/proc/PID/autogroup; 0: left as is). The server runs in a session of
    # its own, and the kernel shares the CPU between sessions before it looks at a process's nice, so `nice -n -10`
    # alone left 0.16.0's client starved: 13 s of CPU in its first 15 minutes, 17 minutes before its first request
    # (2026-12-03). At 10 the client runs when it has work; the server has every cycle the client leaves.
    server_group_nice: int = 0


RELEASES = {
    # vllm-omni 0.30.0: deploy YAML (`stages:`), --deploy-config
    "0.30": Release("0.30", WORK / "venv", MODELS, HERE / "configs", "--deploy-config"),
    # vllm-omni 0.16.0: stage config YAML (`stage_args:` with runtime / engine_args), --stage-configs-path; its
    # transformers 4.57 reads the model's config in the older layout (build_model.py writes it so there)
    "0.16": Release(
        "0.16",
        WORK / "venv-016",
        {"tiny": WORK / "model-016", "light": WORK / "model-light-016", "lean": WORK / "model-lean-016"},
        HERE / "configs" / "0.16",
        "--stage-configs-path",
        "vllm-omni",
        HERE / "client_016",
        -10,
        ("--log-stats",),
        10,
    ),
}
RELEASE = RELEASES["0.30"]  # main() sets the one --release names
PERCENTILE_METRICS = "ttft,tpot,itl,e2el,audio_ttfp,audio_rtf"
# --hosts runs this in place of the default deploy: both stage hops over Mooncake, the only ones that cross hosts
HOSTS_DEPLOY = HERE / "configs" / "qwen3_omni_cpu_mooncake.yaml"
SMOKE_PROMPT = "Say hello to the world."
# The correctness probes: a short prompt and a longer one (a few hundred tokens of prefill payload).
PROBE_PROMPTS = (
    SMOKE_PROMPT,
    "Summarise the following, then read it aloud. "
    + " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(24)),
)


def log(msg: str) -> None:
    print(f"[e2e] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# benchmark client


def run_bench(
    base: str, model: str, args, input_len: int, concurrency: int, out_dir: Path, env: dict[str, str], logf,
    round_: int = 0,
) -> dict:
    num = args.num_prompts if args.num_prompts else max(4, 2 * concurrency)
    if args.duration_s and not args.num_prompts:
        num = 8 * concurrency  # --duration-s: rounds long enough that each one's ramp-down is a small part
    fname = f"bench-in{input_len}-c{concurrency}{f'-r{round_}' if round_ else ''}.json"
    cmd = [
        str(VENV_BIN / RELEASE.bench_cli), "bench", "serve", "--omni",
        "--backend", "openai-chat-omni", "--endpoint", "/v1/chat/completions",
        "--base-url", base, "--model", model, "--tokenizer", model,
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(num), "--max-concurrency", str(concurrency), "--seed", str(args.seed + round_),
        "--percentile-metrics", PERCENTILE_METRICS, "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", fname, "--disable-tqdm",
    ]  # fmt: skip
    if RELEASE.client_nice:
        cmd = ["nice", "-n", str(RELEASE.client_nice), *cmd]
    log(f"benchmark: {' '.join(cmd[1:])}")
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=args.bench_timeout)
    res: dict[str, Any] = {"input_len": input_len, "concurrency": concurrency, "num_prompts": num, "rc": r.returncode,
                           "wall_s": round(time.monotonic() - t0, 1)}  # fmt: skip
    f = out_dir / fname
    if f.exists():
        raw = json.loads(f.read_text())
        res["raw"] = {k: v for k, v in raw.items() if not isinstance(v, list)}
        res["errors"] = bench_errors(f)  # the failed requests' error texts, with counts
    return res


def run_bench_held(base: str, model: str, args, n: int, c: int, arm_dir: Path, env: dict[str, str], clog,
                   on_round: Any = None) -> dict[str, Any]:  # fmt: skip
    """``--duration-s``: the benchmark client again and again (rounds of ``8 x C`` prompts, seed + round) until
    the time is up, so that concurrency C is held that long; one entry with every round and the totals
    (requests sent, answered, failed, their errors). Without it: one run."""
    if not args.duration_s:
        return run_bench(base, model, args, n, c, arm_dir, env, clog)
    t0 = time.monotonic()
    rounds = []
    while not rounds or time.monotonic() - t0 < args.duration_s:
        rounds.append(run_bench(base, model, args, n, c, arm_dir, env, clog, round_=len(rounds) + 1))
        if on_round is not None:
            on_round(rounds[-1])
        if rounds[-1]["rc"] != 0 and not (rounds[-1].get("raw") or {}).get("completed"):
            break  # the client fails outright (the server is gone): no point in more rounds
    totals = client_errors(rounds)
    out: dict[str, Any] = {"input_len": n, "concurrency": c, "duration_s": args.duration_s,
                           "wall_s": round(time.monotonic() - t0, 1), "rounds": rounds, **totals,
                           "num_prompts": totals["sent"], "rc": max(r["rc"] for r in rounds)}  # fmt: skip
    out["raw"] = rounds[0].get("raw")  # the table shows the first round's latencies
    log(f"held c={c} for {out['wall_s']} s: {len(rounds)} rounds, {totals['completed']}/{totals['sent']} answered, "
        f"{totals['failed']} failed")  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------
# one arm


@dataclass
class Arm:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    deploy: Path | None = None  # this arm's deploy config (None: --deploy-config)


def deploy_names() -> list[str]:
    """The NAMEs of ``qwen3_omni_cpu_NAME.yaml`` in the release's config folder."""
    return sorted(p.stem.removeprefix("qwen3_omni_cpu_") for p in RELEASE.configs.glob("qwen3_omni_cpu_*.yaml"))


def resolve_deploy(value: str | Path) -> Path | None:
    """A deploy YAML path, or NAME for the release's ``qwen3_omni_cpu_NAME.yaml``; None when neither exists."""
    path = Path(value) if Path(value).exists() else RELEASE.configs / f"qwen3_omni_cpu_{value}.yaml"
    return path.resolve() if path.is_file() else None


def make_arm(spec: str) -> Arm:
    """``SPEC`` or ``SPEC@CONFIG``: CONFIG is a deploy YAML path, or NAME for ``configs/qwen3_omni_cpu_NAME.yaml``.
    ``ARM#N`` (N a number) is ARM again on a server of its own, named apart (an A-B-A run's second A)."""
    again = re.fullmatch(r"(.+)#(\d+)", spec)
    if again:
        arm = make_arm(again.group(1))
        arm.name = spec
        return arm
    if "@" in spec:
        base, _, cfg = spec.partition("@")
        path = resolve_deploy(cfg)
        if path is None:
            raise SystemExit(
                f"arm {spec!r}: no deploy config {cfg!r} (a path, or NAME of configs/qwen3_omni_cpu_NAME.yaml: "
                f"{', '.join(deploy_names())})"
            )
        arm = make_arm(base)
        arm.name, arm.deploy = spec, path
        return arm
    if spec == "off":
        return Arm("off", {"OMNI_ACCUM_VLLM_OMNI": "0"}, ("OMNI_ACCUM_POLICY",))
    if spec in ("default", "qwen3-omni", "qwen3-omni-flat"):
        return Arm(spec, {"OMNI_ACCUM_VLLM_OMNI": "1", "OMNI_ACCUM_POLICY": spec})
    p = Path(spec)
    if p.exists():
        return Arm(spec, {"OMNI_ACCUM_VLLM_OMNI": "1", "OMNI_ACCUM_POLICY": str(p.resolve())})
    # Let omni-accum resolve any other preset name (or refuse it in the server log).
    return Arm(spec, {"OMNI_ACCUM_VLLM_OMNI": "1", "OMNI_ACCUM_POLICY": spec})


def positive_ints(text: str, option: str) -> list[int]:
    """``8000,16000,32000`` -> [8000, 16000, 32000]; ValueError naming the option and the bad item."""
    items = [t.strip() for t in str(text).split(",")]
    out = []
    for t in items:
        if not t.isdigit() or int(t) <= 0:
            raise ValueError(
                f"{option}: {t!r} in {text!r} is not a positive integer (a comma-separated list, e.g. 8000,32000)"
            )
        out.append(int(t))
    return out


def resolve_model(value: str | Path) -> Path:
    """``tiny`` / ``light`` / ``lean`` (``build_model.py --variant NAME``'s folder for the release) or a model
    folder path."""
    return (RELEASE.models[str(value)] if str(value) in RELEASE.models else Path(value)).resolve()


def set_group_nice(pid: int, nice: int) -> str:
    """Give the autogroup of ``pid``'s session the niceness ``nice`` (what /proc/PID/autogroup says after, or
    why not: a kernel without autogroups, or not allowed)."""
    path = Path(f"/proc/{pid}/autogroup")
    try:
        path.write_text(f"{nice}\n")
        now = path.read_text().strip()
    except OSError as e:
        now = f"not set ({e.strerror or e})"
    log(f"server session {pid}: autogroup {now}")
    return now


def read_from(path: Path, offset: int) -> str:
    """``path``'s text from byte ``offset`` on ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def scrape_or_error(base: str) -> dict[str, Any]:
    try:
        return scrape_metrics(base)
    except Exception as e:  # noqa: BLE001 - a report, not a reason to fail the arm
        return {"error": f"{type(e).__name__}: {e}"}


def cpu_knobs(args) -> dict[str, str]:
    """The environment ``--idle-spin-s`` and ``--omp-wait`` give every arm's server (``off`` included)."""
    env = {}
    if args.idle_spin_s is not None:  # the harness's CPU platform package caps vLLM's busy loop (every arm alike)
        env["OMNI_ACCUM_E2E_IDLE_SPIN_S"] = repr(float(args.idle_spin_s))
    if args.omp_wait is not None:  # read by each worker's OpenMP runtime (torch's libgomp) when it starts
        env["OMP_WAIT_POLICY"] = args.omp_wait.upper()
    return env


def run_arm(arm: Arm, args, run_dir: Path) -> dict[str, Any]:
    arm_dir = run_dir / re.sub(r"[^A-Za-z0-9._-]+", "_", arm.name)
    arm_dir.mkdir(parents=True, exist_ok=True)
    status_dir = arm_dir / "omni-accum-status"
    if status_dir.exists():
        for f in status_dir.glob("*"):
            f.unlink()
    status_dir.mkdir(exist_ok=True)
    prom_dir = arm_dir / "prometheus"
    if prom_dir.exists():
        for f in prom_dir.glob("*"):
            f.unlink()
    prom_dir.mkdir(exist_ok=True)
    server = None  # --hosts: the stages on simulated hosts (hosts.py); else one `vllm-omni serve` here
    if args.hosts:
        server = hosts_mode.HostsServer(
            hosts=args.hosts, deploy=Path(arm.deploy or args.deploy_config), model=Path(args.model), venv_bin=VENV_BIN,
            arm_dir=arm_dir, start_timeout=args.start_timeout, grace=args.stop_grace, log=log,
        ).open()  # fmt: skip
    port = hosts_mode.API_PORT if server else free_port()
    base = server.base if server else f"http://127.0.0.1:{port}"
    no_proxy = ",".join(["127.0.0.1", "localhost", *(server.addresses if server else [])])
    if server:
        os.environ["NO_PROXY"] = os.environ["no_proxy"] = no_proxy  # this process' own requests to the hosts
    env = {k: v for k, v in os.environ.items() if k not in arm.unset}
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            "OMNI_ACCUM_STATUS_DIR": str(status_dir),
            # One folder per arm for every server process's Prometheus values, so that the API server's
            # /metrics shows the stage processes' (vllm-omni with one API server does not set one).
            "PROMETHEUS_MULTIPROC_DIR": str(prom_dir),
            "PATH": f"{VENV_BIN}:{env.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1",
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
        }
    )
    env.update(arm.env)
    env.update(cpu_knobs(args))
    if args.capture:  # every stage process records what passes through omni-accum (omni-accum trace / tune --trace)
        env["OMNI_ACCUM_CAPTURE"] = str(Path(args.capture).resolve() / arm_dir.name)
    # The benchmark client loads vllm-omni's plugins too: keep omni-accum out of it (and out of the
    # status folder, which is for the server's processes).
    server_only = ("OMNI_ACCUM_STATUS_DIR", "OMNI_ACCUM_POLICY", "PROMETHEUS_MULTIPROC_DIR", "OMNI_ACCUM_CAPTURE")
    client_env = {k: v for k, v in env.items() if k not in server_only}
    client_env["OMNI_ACCUM_VLLM_OMNI"] = "0"
    if RELEASE.client_path is not None:
        client_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(RELEASE.client_path), env.get("PYTHONPATH")) if p)
    server_log = arm_dir / "server.log"
    client_log = arm_dir / "client.log"
    cmd = [
        str(VENV_BIN / "vllm-omni"), "serve", str(args.model), "--omni",
        "--host", "127.0.0.1", "--port", str(port),
        RELEASE.config_flag, str(arm.deploy or args.deploy_config),
        "--stage-init-timeout", str(int(args.start_timeout)), *RELEASE.server_flags,
    ]  # fmt: skip
    result: dict[str, Any] = {
        "arm": arm.name,
        "env": arm.env,
        "port": port,
        "server_cmd": cmd,
        "server_log": str(server_log),
        "status_dir": str(status_dir),
    }
    if server:
        server_log = arm_dir / "api.log"  # the head's; each host's process logs to <arm dir>/<host>.log
        result["server_log"] = str(server_log)
        result["server_cmd"] = None  # the head's, once it starts (result["hosts"]["commands"]: every host's)
    shm_before = shm_entries()
    if server:
        cmd = []  # each host's command is logged as it starts (hosts.py), and in result["hosts"]
        log(f"[{arm.name}] starting on {args.hosts} hosts (env {arm.env}; logs {arm_dir}/<host>.log)")
    else:
        log(f"[{arm.name}] starting: {' '.join(cmd)} (env {arm.env}; log {server_log})")
    t0 = time.monotonic()
    known: list[dict[str, Any]] = []
    sampler = killer = None  # --sample-every-s, --kill-stage
    with open(os.devnull if server else server_log, "wb") as slog, open(client_log, "ab") as clog:
        proc = None
        try:
            if server:
                result["hosts"] = server.describe()  # its "commands" fill in as each host's process starts
                proc = server.start(env).popen
                result["server_cmd"] = server.commands["api"]
            else:
                proc = subprocess.Popen(cmd, env=env, stdout=slog, stderr=subprocess.STDOUT, start_new_session=True)
                if RELEASE.server_group_nice:
                    result["server_group_nice"] = set_group_nice(proc.pid, RELEASE.server_group_nice)
            result["server_pid"] = proc.pid
            ready_s = server.wait_ready(args.start_timeout) if server else wait_ready(base, proc, args.start_timeout)
            result["start_s"] = round(ready_s, 1)
            result["started"] = True
            known = server.processes() if server else server_processes(proc.pid)
            log(f"[{arm.name}] ready in {result['start_s']} s on port {port}, {len(known)} processes")
            root = proc.pid
            listing = (lambda: server.processes()) if server else (lambda: server_processes(root))  # noqa: E731
            if args.sample_every_s > 0:
                sampler = Sampler(root, args.sample_every_s, processes=listing).start()
            if args.kill_stage is not None:
                killer = StageKiller(
                    args.kill_stage, args.kill_after_s, listing, log_path=server_log,
                    on_kill=lambda r: (log(f"[{arm.name}] SIGKILL stage{r['stage']} pid {r.get('pid')} "
                                           f"({r.get('note') or r.get('title', '')[:60]})"),
                                       sampler and sampler.mark(f"SIGKILL stage{r['stage']}", pid=r.get("pid"))),
                )  # fmt: skip
            probes = []
            for prompt in PROBE_PROMPTS[:1] if args.smoke else PROBE_PROMPTS:
                c = chat_with_audio(base, str(args.model), args.smoke_max_tokens, args.request_timeout, prompt)
                c["prompt_sha256"] = hashlib.sha256(prompt.encode()).hexdigest()[:16]
                probes.append(c)
                log(
                    f"[{arm.name}] chat: HTTP {c.get('http_status')}, prompt {len(prompt)} chars, "
                    f"{(c.get('usage') or {}).get('prompt_tokens')} tokens, text {c.get('text', '')[:40]!r}, "
                    f"audio {c.get('audio_bytes', 0)} bytes sha {str(c.get('audio_sha256'))[:12]}, "
                    f"{c.get('latency_s')} s"
                )
            result["correctness"] = dict(probes[0], probes=probes)
            # The benchmark after the probes: the talker samples (temperature 0.9, seed 42 in the deploy
            # config) and its audio depends on the traffic the server saw before, so the probes run on
            # a fresh server in every arm.
            if not args.smoke:
                result["bench"] = []
                for n in args.input_len:
                    for c in args.concurrency:
                        before = scrape_or_error(base)
                        log_from = server_log.stat().st_size if server_log.exists() else 0
                        if sampler:
                            sampler.mark(f"bench in{n} c{c}")
                        if killer:
                            killer.arm()  # once: its time counts from the first benchmark's start
                        if server and args.hosts_fault:
                            server.arm_fault(args.hosts_fault, args.kill_after_s)  # once, as the killer
                        b = run_bench_held(base, str(args.model), args, n, c, arm_dir, client_env, clog)
                        after = scrape_or_error(base)
                        # the server's own hand-off and processor times for this benchmark's requests
                        b["server"] = metrics_delta(before, after)
                        b["fallbacks"] = fallbacks_delta(before, after)  # omni-accum's during it, by reason
                        b["memcpy_ms"] = payload_memcpy_ms(n)
                        if "--log-stats" in RELEASE.server_flags:  # the stages' own times, from this benchmark's lines
                            b["stages"] = stage_rows(stage_requests(read_from(server_log, log_from)))
                        result["bench"].append(b)
                if server and args.hosts_fault:
                    result["fault"] = server.fault_report(result["bench"])
                    said = {k: v for k, v in result["fault"].items() if k != "log_lines"}
                    log(f"[{arm.name}] after the fault: {json.dumps(said)}")
                if killer:
                    killer.cancel()
                    result["fault"] = fault_report(
                        killer.record, listing(), proc.poll() is None, health_status(base), server_log, result["bench"]
                    )
                    log(f"[{arm.name}] after the kill: {json.dumps({k: v for k, v in result['fault'].items() if k != 'log_lines'})}")
            time.sleep(1)
            result["metrics"] = scrape_or_error(base)  # what omni-accum counted, as an operator's scrape sees it
            try:  # the raw scrape too, for `omni-accum ab --metrics FILE` (an A/B split's arms) and other readers
                with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
                    (arm_dir / "metrics.prom").write_bytes(r.read())
                result["metrics_file"] = str(arm_dir / "metrics.prom")
            except OSError as e:
                log(f"[{arm.name}] could not save /metrics: {e}")
            print_metrics(arm.name, result["metrics"])
            snap = {i["pid"]: i for i in known}
            snap.update({i["pid"]: i for i in (server.processes() if server else server_processes(proc.pid))})
            known = sorted(snap.values(), key=lambda i: i["pid"])
            live = [proc_info(i["pid"]) for i in known if alive(i)]
            result["rss_total_mb"] = round(sum(i["rss_mb"] or 0 for i in live if i), 1)
            result["pss_total_mb"] = round(sum(i["pss_mb"] or 0 for i in live if i), 1)
            log(f"[{arm.name}] memory: PSS {result['pss_total_mb']:.0f} MB (RSS sum {result['rss_total_mb']:.0f} MB)")
        except Exception as e:  # noqa: BLE001 - report, then always clean up
            result.setdefault("started", False)
            result["error"] = f"{type(e).__name__}: {e}"
            log(f"[{arm.name}] {result['error']}")
            snap = {i["pid"]: i for i in known}
            if server:
                snap.update({i["pid"]: i for i in server.processes()})
            elif proc is not None:
                snap.update({i["pid"]: i for i in server_processes(proc.pid)})
            known = sorted(snap.values(), key=lambda i: i["pid"])
        finally:  # also on Ctrl-C and SIGTERM (netns.Interrupted, --hosts): nothing of the arm stays
            if killer:
                killer.cancel()
                if "fault" not in result:
                    result["fault"] = fault_report(killer.record, [], False, None, server_log, result.get("bench"))
            if server and args.hosts_fault and "fault" not in result:
                server.cancel_fault()
                result["fault"] = server.fault_report(result.get("bench"))
            if sampler:
                sampler.stop()
            status_before = read_status_dir(status_dir)
            if server:
                result["stop"] = server.stop(known)
            elif proc is not None:
                result["stop"] = stop_server(proc, known, port, args.stop_grace)
            else:
                result["stop"] = {"clean": False, "note": "the server never started"}
            # what omni-accum left in /dev/shm and its private folder (its reapers remove a killed process's)
            result["stop"]["omni_accum_left"] = omni_accum_left(shm_before, shm_entries)
            result["stop"]["shm"] = shm_cleanup(shm_before)
            log(f"[{arm.name}] stopped: {result['stop']}")
            if sampler:
                sampler.sample()  # after the stop: what /dev/shm holds once the server is gone
                sampler.mark("stopped")
                result["memory"] = sampler.write(arm_dir, args.warmup_s)
                log(f"[{arm.name}] memory samples: {result['memory']['csv']}; plot: {result['memory']['plot']}")
    result["wall_s"] = round(time.monotonic() - t0, 1)
    status = read_status_dir(status_dir) or status_before  # refreshed at exit; else the last refresh
    logs = scan_log(server_log)
    if server:  # the stages' log lines are in their hosts' own files
        for f in sorted(arm_dir.glob("stage*.log")):
            logs.update(scan_log(f))
    result["processes"] = [
        {
            "pid": i["pid"],
            "ppid": i["ppid"],
            "comm": i["comm"],
            "title": i["title"],
            "rss_mb": i["rss_mb"],
            "pss_mb": i.get("pss_mb"),
            "role": role_of(i, {k["pid"]: k for k in known}),
            **({"host": i["host"]} if "host" in i else {}),
        }
        for i in known
    ]
    result["status_files"] = len([p for p in status if p > 0])
    result["status_raw"] = {str(k): v for k, v in status.items()}
    result["coverage"] = coverage(known, status, logs)
    print_coverage(arm.name, result["coverage"], result["status_files"], arm.env.get("OMNI_ACCUM_VLLM_OMNI") == "0")
    if args.keep_logs:
        keep = Path(args.keep_logs) / arm_dir.name
        keep.mkdir(parents=True, exist_ok=True)
        for f in (server_log, client_log, *(sorted(arm_dir.glob("*.log")) if server else []),
                  *sorted(arm_dir.glob("memory.*"))):  # fmt: skip
            if f.exists():
                (keep / f.name).write_bytes(f.read_bytes())
    return result


def _interrupted(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--arms",
        default="off,default,qwen3-omni",
        help="comma-separated: off, default, qwen3-omni, or policy file paths; ARM@CONFIG runs ARM with "
        "another deploy config (a path, or NAME of configs/qwen3_omni_cpu_NAME.yaml, e.g. off@arena); ARM#N "
        "runs ARM again on a fresh server, named apart: off,qwen3-omni@arena,off#2 shows in off#2's ratios how far "
        "the machine drifted during the run (default %(default)s)",
    )
    ap.add_argument(
        "--input-len",
        default="8000",
        help="prompt tokens, comma-separated: the benchmark runs once per length on each arm's server "
        "(default %(default)s)",
    )
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--concurrency", default="1", help="comma-separated list (default %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=0, help="per concurrency (default: max(4, 2 x concurrency))")
    ap.add_argument("--seed", type=int, default=0, help="benchmark dataset seed")
    ap.add_argument("--json", dest="json_out", type=Path, help="write every result here")
    ap.add_argument("--keep-logs", type=Path, help="copy each arm's server / client logs here")
    ap.add_argument(
        "--capture",
        type=Path,
        metavar="DIR",
        help="record each arm's stream through omni-accum (OMNI_ACCUM_CAPTURE) into DIR/ARM, for `omni-accum trace "
        "DIR/ARM` and `omni-accum tune --trace DIR/ARM` (arms with omni-accum on only)",
    )
    ap.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="run each arm's server across N simulated hosts (network namespaces; root): the Mooncake master, "
        "the API server with stage 0, one per other stage (4 for Qwen3-Omni), over "
        "configs/qwen3_omni_cpu_mooncake.yaml in place of the default deploy. 0: one host (default)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="one short chat request with audio per arm (the first probe only), no benchmark client",
    )
    ap.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"{' or '.join(MODELS)} (build_model.py --variant NAME's folder) or a model folder (default %(default)s)",
    )
    ap.add_argument(
        "--deploy-config",
        default=None,
        help="a deploy YAML, or NAME of configs/qwen3_omni_cpu_NAME.yaml (default configs/qwen3_omni_cpu.yaml; "
        "with --release 0.16 the stage configs of configs/0.16/)",
    )
    ap.add_argument(
        "--release",
        choices=sorted(RELEASES),
        default=None,
        help="the vllm-omni release's server environment: its virtualenv (setup_env.sh --release NAME), its model "
        "folders (build_model.py run with that virtualenv's python) and its config format / folder "
        "(default: the virtualenv of the python running this script, 0.30's configs)",
    )
    ap.add_argument(
        "--idle-spin-s",
        type=float,
        default=None,
        metavar="S",
        help="every arm's server: vLLM's shared-memory message-queue readers busy-loop at most S seconds after a "
        "message before they sleep on its notification (vLLM 0.30.0 spins 1 s, sched_yield in a loop: each engine "
        "core while its worker computes, each worker between steps; on a GPU server they have cores to spare, on "
        "2 cores they take a third of the CPU from the stages' work and hand-offs). 0: sleep at once. A sleeping "
        "reader looks again every 10 ms (vLLM's own 5 s recheck made a lost notification stall a stage 5 s). "
        "Done by the harness's CPU platform package (OMNI_ACCUM_E2E_IDLE_SPIN_S), the same for every arm, off "
        "included; omni-accum plays no part. Default: vLLM's own",
    )
    ap.add_argument(
        "--omp-wait",
        choices=("passive", "active"),
        default=None,
        help="every arm's server: OMP_WAIT_POLICY of its processes' OpenMP runtime (torch's libgomp). passive: a "
        "thread that reaches a barrier or runs out of work sleeps at once; libgomp's default spins first, and "
        "with three stage workers' thread pools on 2 cores the spinning took ~40 %% of the CPU (a light-model 8k "
        "request: 40.6 s of CPU under the default, 24.7 s under passive). The same for every arm, off included; "
        "omni-accum plays no part. Default: the environment's OMP_WAIT_POLICY, else libgomp's own",
    )
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--bench-timeout", type=float, default=3600.0)
    ap.add_argument("--stop-grace", type=float, default=60.0, help="seconds after SIGTERM before SIGKILL")
    ap.add_argument("--smoke-max-tokens", type=int, default=16, help="thinker max_tokens of the correctness request")
    ap.add_argument("--work-dir", type=Path, default=WORK / "runs", help="per-run folders (logs, status files)")
    ap.add_argument(
        "--sample-every-s",
        type=float,
        default=5.0,
        help="while an arm's server runs, record every N seconds the RSS of each server process (VmRSS), the bytes "
        "in omni-accum's private folder (/dev/shm/omni-accum-<euid>/) and the bytes in use on /dev/shm, into "
        "<run>/<arm>/memory.csv and memory.json, and plot them to memory.png (needs matplotlib; without it the "
        "data only, and the report says so). 0: off (default %(default)s)",
    )
    ap.add_argument(
        "--warmup-s",
        type=float,
        default=60.0,
        help="samples before this many seconds after the server was ready are left out of the flatness verdict "
        "(memory.json 'flat': each series' growth from its first to its last quarter; default %(default)s)",
    )
    ap.add_argument(
        "--duration-s",
        type=float,
        default=0.0,
        help="hold each concurrency at least this long: the benchmark client runs again and again (rounds of "
        "8 x C prompts unless --num-prompts, the seed + 1 per round) until the time is up; the JSON has every "
        "round, the requests sent / answered / failed with their errors, and omni-accum's fallbacks from "
        "/metrics by reason. 0: one run (default)",
    )
    ap.add_argument(
        "--kill-stage",
        default=None,
        help="fault injection: SIGKILL this stage's engine-core process (thinker, talker, code2wav, or a stage "
        "number) --kill-after-s after the first benchmark starts, then record what the server did (still "
        "running, /health, the stage restarted or not, new processes, the client's errors, the server log's "
        "error / death / restart lines after the kill) in the arm's 'fault' entry; after the stop, "
        "'stop.omni_accum_left' lists what omni-accum left in /dev/shm (it should be empty). Needs the benchmark "
        "(not with --smoke); give a short --bench-timeout, a killed stage can leave the client waiting",
    )
    ap.add_argument(
        "--hosts-fault",
        default=None,
        metavar="FAULT",
        help="with --hosts, a fault --kill-after-s after the first benchmark starts: master-restart[:DOWN_S] "
        "(SIGKILL mooncake_master, a fresh one on the same address DOWN_S seconds later, default 5) or "
        "link-down:ROLE[:SECONDS] (host ROLE's link down SECONDS, default 5, then up: mooncake, api, stage1, "
        "stage2); the arm's 'fault' entry says what vllm-omni did (/health, the processes, the client's errors, "
        "each host's error lines after it); 'stop.omni_accum_left' what omni-accum left. Needs the benchmark",
    )
    ap.add_argument(
        "--kill-after-s",
        type=float,
        default=30.0,
        help="seconds after the first benchmark starts, for --kill-stage and --hosts-fault (default %(default)s)",
    )
    args = ap.parse_args(argv)
    # SIGTERM / SIGHUP end this script as Ctrl-C does, through each arm's clean-up (the server's process group
    # stopped, its /dev/shm files checked): the default action left a running server behind.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupted)
    global RELEASE, VENV_BIN
    if args.release is not None:
        RELEASE = RELEASES[args.release]
        venv = Path(os.environ.get("OMNI_ACCUM_E2E_VENV") or RELEASE.venv)
        if not (venv / "bin" / "vllm-omni").exists():
            ap.error(
                f"--release {args.release}: no vllm-omni in {venv} "
                f"(run: bash benchmarks/e2e/setup_env.sh --release {args.release})"
            )
        VENV_BIN = venv / "bin"
    if args.deploy_config is None:
        args.deploy_config = str(RELEASE.configs / "qwen3_omni_cpu.yaml")
    if args.kill_stage is not None:
        try:
            args.kill_stage = stage_number(args.kill_stage)
        except ValueError as e:
            ap.error(str(e))
        if args.smoke:
            ap.error("--kill-stage needs the benchmark (it kills the stage while the benchmark runs): drop --smoke")
    for opt in ("sample_every_s", "warmup_s", "duration_s", "kill_after_s", "idle_spin_s"):
        if getattr(args, opt) is not None and not getattr(args, opt) >= 0:
            ap.error(f"--{opt.replace('_', '-')}: {getattr(args, opt)} is negative (seconds, 0 or more)")
    try:
        args.concurrency = positive_ints(args.concurrency, "--concurrency")
        args.input_len = positive_ints(args.input_len, "--input-len")
    except ValueError as e:
        ap.error(str(e))
    model_name = str(args.model)
    args.model = resolve_model(args.model)
    if not (args.model / "config.json").exists():
        how = f"build_model.py --variant {model_name}" if model_name in RELEASE.models else "build_model.py --out DIR"
        if RELEASE.name != "0.30" and model_name in RELEASE.models:
            how = f"{VENV_BIN / 'python'} benchmarks/e2e/{how}"
        ap.error(
            f"--model {model_name}: no model at {args.model} (run {how} first; names: {', '.join(RELEASE.models)})"
        )
    deploy = resolve_deploy(args.deploy_config)
    if deploy is None:
        ap.error(
            f"--deploy-config {args.deploy_config}: no such file, nor a NAME of configs/qwen3_omni_cpu_NAME.yaml "
            f"({', '.join(deploy_names())})"
        )
    args.deploy_config = deploy
    try:
        arms = [make_arm(a.strip()) for a in args.arms.split(",") if a.strip()]
    except SystemExit as e:
        ap.error(str(e))
    names = [a.name for a in arms]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        ap.error(f"--arms: {', '.join(twice)} given twice (to run an arm again on a server of its own, name it ARM#2)")
    if args.hosts and RELEASE.name != "0.30":
        ap.error(f"--hosts {args.hosts}: the simulated hosts run vllm-omni 0.30.0's deploys (not --release {RELEASE.name})")
    if args.hosts_fault is not None and (not args.hosts or args.smoke):
        ap.error(f"--hosts-fault {args.hosts_fault}: needs --hosts N and the benchmark (not --smoke)")
    if args.hosts:
        if args.hosts < 0:
            ap.error(f"--hosts: {args.hosts} is not a host count (0: one host; 4 for the Qwen3-Omni deploys)")
        if (HERE / "configs" / "qwen3_omni_cpu.yaml").resolve() == Path(args.deploy_config).resolve():
            args.deploy_config = HOSTS_DEPLOY.resolve()  # shared memory does not cross hosts
        for arm in arms:
            try:
                roles = hosts_mode.plan(Path(arm.deploy or args.deploy_config), args.hosts)
                if args.hosts_fault is not None:
                    fault = hosts_mode.parse_fault(args.hosts_fault, roles)
            except (hosts_mode.HostsUsageError, OSError) as e:
                ap.error(f"arm {arm.name}: {e}")
        if args.hosts_fault is not None:
            args.hosts_fault = fault
        # root, ip, namespaces, Mooncake: without them the mode says so and stops
        why = hosts_mode.prerequisites(VENV_BIN / "python")
        if why:
            print(f"run.py --hosts {args.hosts}: {why}", file=sys.stderr)
            return 2
    args.work_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=args.work_dir))
    log(f"run folder {run_dir}")

    results = []
    for arm in arms:
        results.append(run_arm(arm, args, run_dir))
    print_table(results)
    cmp_ = compare(results)
    print("\ncorrectness (temperature-0 chat with audio)")
    for r in results:
        for i, c in enumerate((r.get("correctness") or {}).get("probes") or [{}]):
            print(
                f"  {r['arm'] if i == 0 else '':<24} probe {i}: HTTP {c.get('http_status', '-')}, "
                f"text {c.get('text', '')[:30]!r}, audio {c.get('audio_bytes', 0)} B "
                f"sha {str(c.get('audio_sha256'))[:12]}"
            )
        if r["arm"] in cmp_:
            print(f"  {'':<24} equals off: {cmp_[r['arm']]}")
    ok = True
    for r in results:
        probes = (r.get("correctness") or {}).get("probes") or [{}]
        if not r.get("started") or any(
            c.get("http_status") != 200 or not c.get("text") or not c.get("audio_bytes") for c in probes
        ):
            ok = False
        if not (r.get("stop") or {}).get("clean"):
            ok = False
    if "default" in cmp_ and not cmp_["default"]["equals_off"]:
        log("FAIL: the default arm differs from off")
        ok = False
    summary = {"ok": ok, "run_dir": str(run_dir), "args": {k: str(v) for k, v in vars(args).items()},
               "arms": results, "comparison": cmp_}  # fmt: skip
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(summary, indent=1, default=str))
        log(f"wrote {args.json_out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
