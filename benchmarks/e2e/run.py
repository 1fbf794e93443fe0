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
ITL p50/p99, audio TTFP, audio RTF per arm, ratio to the first ``off`` arm, e.g. ``off@NAME``; the
server's hand-off and processor accumulation times and the hand-off's share of audio TTFP), compares the
correctness outputs with that arm's (``default`` must equal it byte for byte) and writes ``--json``.

Only one server runs at a time. Exit status: 0 when every arm started, answered with text and
audio, answered every benchmark request (but in a fault run, which reports them), ran with omni-accum as its name says (bound in the stage processes when on, installed nowhere
when off) and was cleaned up, and `default` equals the first `off` arm (`off`, `off@NAME`) when both ran; 1
otherwise; 2 for a bad option (checked before any server starts); 130 when interrupted (`--json` then holds the
arms that ended).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
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
    alive, chat_with_audio, coverage, coverage_problem, free_port, print_coverage, proc_info, read_status_dir,
    role_of, scan_log, server_processes, shm_cleanup, shm_entries, stop_server, wait_ready,
)  # fmt: skip
from e2e_report import (  # noqa: E402
    compare, metrics_delta, off_arm, payload_memcpy_ms, print_metrics, print_table, scrape_metrics, stage_requests,
    stage_rows,
)  # fmt: skip
from e2e_watch import (  # noqa: E402 - memory samples, a stage killed on purpose, omni-accum's leftovers
    Sampler, StageKiller, bench_errors, client_errors, fallbacks_delta, fault_report, health_status, omni_accum_left,
    stage_number,
)  # fmt: skip

import hosts as hosts_mode  # noqa: E402 - run.py --hosts N (network namespaces, netns.py)
from e2e_options import (  # noqa: E402 - the options, and the checks of their values
    build_parser, check_deploy, check_outputs, check_values, option, positive_ints,  # noqa: F401 - positive_ints: the tests
)  # fmt: skip

WORK = HERE / ".work"
MODELS = {"tiny": WORK / "model", "light": WORK / "model-light", "lean": WORK / "model-lean"}  # --variant NAME
DEFAULT_MODEL = "tiny"
INTERPRETER_BIN = Path(sys.executable).parent  # the python running this script: its virtualenv's bin/
VENV_BIN = INTERPRETER_BIN  # the server's (main() sets it: --release's virtualenv, else this one)


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


def probe_tokens(smoke: bool = False) -> int:
    """At most how many tokens the longest correctness probe's prompt takes (--smoke: the first probe only): one
    per UTF-8 byte (the tiny models' byte-level tokenizer; a real one takes fewer) and the chat template's 32."""
    return max(len(p.encode()) for p in (PROBE_PROMPTS[:1] if smoke else PROBE_PROMPTS)) + 32


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
        "--save-detailed",  # without it the client deletes the failed requests' error texts from the result
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
    ``ARM#N`` (N a number) is ARM again on a server of its own, named apart (an A-B-A run's second A). SPEC is
    ``off`` or a policy omni-accum loads (a preset or a policy file), checked here as the server's stages would
    load it: an arm whose policy they refused would run vllm-omni's own code under the arm's name.
    SystemExit naming the arm and what it takes."""
    again = re.fullmatch(r"(.*)#(\d+)", spec)
    if again:
        if not again.group(1):
            raise SystemExit(f"arm {spec!r}: ARM#N needs an ARM before the '#' (e.g. off{spec} or qwen3-omni{spec})")
        arm = make_arm(again.group(1))
        arm.name = spec
        return arm
    if "@" in spec:
        base, _, cfg = spec.partition("@")
        if not base:  # the arm (its policy) first: '@' alone names neither
            eg = cfg or "arena"
            raise SystemExit(f"arm {spec!r}: no arm before '@' (e.g. off@{eg} or qwen3-omni@{eg}: the arm's policy, "
                             "off, a preset or a policy file)")  # fmt: skip
        path = resolve_deploy(cfg) if cfg else None
        if path is None:
            names = ", ".join(deploy_names()) or f"none in {RELEASE.configs} for --release {RELEASE.name}"
            said = ("no deploy config after '@'" if not cfg else f"{cfg!r} is a folder, not a deploy config"
                    if Path(cfg).is_dir() else f"no deploy config {cfg!r}")  # fmt: skip
            raise SystemExit(
                f"arm {spec!r}: {said} (a path, or NAME of "
                f"{RELEASE.configs.relative_to(HERE)}/qwen3_omni_cpu_NAME.yaml: {names})"
            )
        arm = make_arm(base)
        arm.name, arm.deploy = spec, path
        return arm
    if spec == "off":
        return Arm("off", {"OMNI_ACCUM_VLLM_OMNI": "0"}, ("OMNI_ACCUM_POLICY",))
    from omni_accum import OmniAccumError, load_policy, preset_names

    try:
        load_policy(spec)
    except OmniAccumError as e:  # a policy's problems (each), a plugin or an OMNI_ACCUM_* switch that is wrong
        said = "; ".join(getattr(e, "errors", None) or [" ".join(str(e).split())]) or type(e).__name__
        raise SystemExit(
            f"arm {spec!r}: {said} (an arm is off, a preset: {', '.join(preset_names())}, or a policy file)"
        ) from None
    policy = str(Path(spec).resolve()) if Path(spec).is_file() else spec
    return Arm(spec, {"OMNI_ACCUM_VLLM_OMNI": "1", "OMNI_ACCUM_POLICY": policy})


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
    """The environment ``--idle-spin-s``, ``--omp-wait`` and ``--executor`` give every arm's server (``off``
    included)."""
    env = {}
    if args.idle_spin_s is not None:  # the harness's CPU platform package caps vLLM's busy loop (every arm alike)
        env["OMNI_ACCUM_E2E_IDLE_SPIN_S"] = repr(float(args.idle_spin_s))
    if args.omp_wait is not None:  # read by each worker's OpenMP runtime (torch's libgomp) when it starts
        env["OMP_WAIT_POLICY"] = args.omp_wait.upper()
    if args.executor is not None:  # the harness's CPU platform package keeps vLLM's in-process executor (uni)
        env["OMNI_ACCUM_E2E_EXECUTOR"] = args.executor
    return env


def arm_folder(name: str) -> str:
    """The folder of arm ``name`` in the run folder."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def run_arm(arm: Arm, args, run_dir: Path) -> dict[str, Any]:
    arm_dir = run_dir / arm_folder(arm.name)
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
        )  # fmt: skip
    try:  # from the lab's first namespace on, whatever happens before the arm's own try (whose finally stops it)
        if server is not None:
            server.open()
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
            paths = (str(RELEASE.client_path), env.get("PYTHONPATH"))
            client_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        server_log = arm_dir / "server.log"
        client_log = arm_dir / "client.log"
        cmd = [
            str(VENV_BIN / "vllm-omni"), "serve", str(args.model), "--omni",
            "--host", "127.0.0.1", "--port", str(port),
            RELEASE.config_flag, str(arm.deploy or args.deploy_config),
            "--stage-init-timeout", str(math.ceil(args.start_timeout)), *RELEASE.server_flags,  # whole seconds, > 0
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
        proc = None
        slog = open(os.devnull if server else server_log, "wb")  # noqa: SIM115 - closed by the with below
        clog = open(client_log, "ab")  # noqa: SIM115 - closed by the with below
    except BaseException:  # also Ctrl-C and SIGTERM (netns.Interrupted): the lab's namespaces, bridge and route go
        if server is not None:
            server.stop([])
        raise
    with slog, clog:
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


def installed_release(venv_bin: Path) -> str | None:
    """The vllm-omni release installed beside ``venv_bin`` (``0.30``, ``0.16``, ``0.28`` ...; ``unknown`` when its
    version cannot be read), or None when there is no vllm-omni there."""
    if not (venv_bin / "vllm-omni").exists():
        return None
    found = sorted(venv_bin.parent.glob("lib/python*/site-packages/vllm_omni-*.dist-info"))
    if not found:
        return "unknown"
    version = found[0].name.removeprefix("vllm_omni-").removesuffix(".dist-info")
    m = re.match(r"(\d+)\.(\d+)", version)  # 0.30.0, 0.30.0.post1, 0.30.0rc1: the 0.30 release
    return f"{m.group(1)}.{m.group(2)}" if m else "unknown"


def check_release(ap: argparse.ArgumentParser, given: str | None) -> None:
    """The server environment: ``--release``'s virtualenv, else the one of the python running this script; it must
    hold that release's vllm-omni (a 0.16.0 server started with 0.30's deploy and model fails minutes later)."""
    global RELEASE, VENV_BIN
    RELEASE, VENV_BIN = RELEASES["0.30"], INTERPRETER_BIN  # what a run without --release starts
    if given is not None:
        RELEASE = RELEASES[given]
        venv = Path(os.environ.get("OMNI_ACCUM_E2E_VENV") or RELEASE.venv)
        if not (venv / "bin" / "vllm-omni").exists():
            ap.error(
                f"--release {given}: no vllm-omni in {venv} (run: bash benchmarks/e2e/setup_env.sh --release {given})"
            )
        VENV_BIN = venv / "bin"
    found = installed_release(VENV_BIN)
    if found is None:
        ap.error(
            f"no vllm-omni beside {VENV_BIN / 'python'}: run this script with the harness's python, "
            f"{RELEASES['0.30'].venv / 'bin' / 'python'} (bash benchmarks/e2e/setup_env.sh builds it)"
        )
    if found != RELEASE.name and found != "unknown":
        fix = f"add --release {found}" if found in RELEASES else f"the harness runs {', '.join(RELEASES)}"
        ap.error(f"{VENV_BIN.parent} has vllm-omni {found}, and this run is for {RELEASE.name}'s server: {fix}")
    if not list(VENV_BIN.parent.glob("lib/python*/site-packages/torchvision-*.dist-info")):
        # the project's own .venv: vllm-omni's classes import there, and `vllm-omni serve` dies at its first import
        ap.error(
            f"{VENV_BIN.parent} has vllm-omni but no torchvision, so `vllm-omni serve` cannot start there (the "
            f"project's .venv is such an environment): run this script with the harness's python, "
            f"{RELEASE.venv / 'bin' / 'python'} (bash benchmarks/e2e/setup_env.sh"
            f"{'' if RELEASE.name == '0.30' else ' --release ' + RELEASE.name} builds it)"
        )


def write_json(path: Path, summary: dict[str, Any]) -> None:
    """``--json``, whole or not at all (a temporary file beside it, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    os.replace(tmp, path)


def bench_problem(r: dict[str, Any]) -> str | None:
    """Why an arm's benchmark figures do not stand for all its requests, or None: the arm stopped on an error
    (a ``--bench-timeout`` too), a client that exited non-zero, or requests not answered (the client's
    percentiles are over the answered ones only)."""
    if r.get("error"):
        return r["error"]
    for b in r.get("bench") or []:
        raw = b.get("raw") or {}
        cell = f"input {b.get('input_len')}, concurrency {b.get('concurrency')}"
        if b.get("rc") or "completed" not in raw:
            return f"{cell}: the benchmark client exited {b.get('rc')}" + ("" if raw else " without a result")
        done, failed = (b["completed"], b["failed"]) if "rounds" in b else (raw["completed"], raw.get("failed"))
        if failed or int(done) < int(b.get("num_prompts") or 0):  # --duration-s: every round's totals
            errors = "; ".join(f"{n}x {t}" for t, n in (b.get("errors") or {}).items())
            return (f"{cell}: {done} of {b.get('num_prompts')} requests answered, {failed} "
                    f"failed{': ' + errors if errors else ''}")  # fmt: skip
    return None


def verdict(results: list[dict[str, Any]], say: Any = log) -> bool:
    """Every arm started, answered each probe with text and audio and every benchmark request (but in a fault run),
    ran with omni-accum as its name says (bound in the stages when on, nowhere when off) and was cleaned up, and
    `default` equals the first off arm (logged where not)."""
    ok = True
    for r in results:
        probes = (r.get("correctness") or {}).get("probes") or [{}]
        if not r.get("started") or any(
            c.get("http_status") != 200 or not c.get("text") or not c.get("audio_bytes") for c in probes
        ):
            ok = False
        if not (r.get("stop") or {}).get("clean"):
            ok = False
        problem = r.get("started") and coverage_problem(r)
        if problem:
            say(f"FAIL: arm {r['arm']}: {problem}")
            ok = False
        if "fault" not in r and (lost := bench_problem(r)):  # a fault run reports its failed requests itself
            say(f"FAIL: arm {r['arm']}: {lost}")
            ok = False
    cmp_ = compare(results)
    if "default" in cmp_ and not cmp_["default"]["equals_off"]:
        say(f"FAIL: the default arm differs from {off_arm([r['arm'] for r in results])}")
        ok = False
    return ok


def print_correctness(results: list[dict[str, Any]]) -> None:
    cmp_ = compare(results)
    ref = off_arm([r["arm"] for r in results])  # the arm the others are compared with
    print("\ncorrectness (temperature-0 chat with audio)")
    for r in results:
        for i, c in enumerate((r.get("correctness") or {}).get("probes") or [{}]):
            print(
                f"  {r['arm'] if i == 0 else '':<24} probe {i}: HTTP {c.get('http_status', '-')}, "
                f"text {c.get('text', '')[:30]!r}, audio {c.get('audio_bytes', 0)} B "
                f"sha {str(c.get('audio_sha256'))[:12]}"
            )
        if r["arm"] in cmp_:
            print(f"  {'':<24} equals {ref}: {cmp_[r['arm']]}")


def report(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--report FILE``: a saved run's tables and probe comparison, as the run printed them; nothing started."""
    others = [option(k) for k, v in vars(args).items() if k != "report" and v != ap.get_default(k)]
    if others:
        ap.error(f"--report reads a saved run and starts nothing, so {', '.join(others)} would do nothing: drop "
                 f"{'them' if len(others) > 1 else 'it'} or --report")  # fmt: skip
    path = args.report
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        ap.error(f"--report {path}: cannot read it ({getattr(e, 'strerror', None) or e})")
    except json.JSONDecodeError as e:
        ap.error(f"--report {path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})")
    arms = saved.get("arms") if isinstance(saved, dict) else None
    if not isinstance(arms, list) or not all(isinstance(a, dict) and "arm" in a for a in arms):
        ap.error(f"--report {path}: not a run.py --json file (no list of arms with their results)")
    given = saved.get("args") if isinstance(saved.get("args"), dict) else {}
    print(f"run {saved.get('run_dir', '?')}: arms {given.get('arms', '?')}, input {given.get('input_len', '?')}, "
          f"concurrency {given.get('concurrency', '?')}, prompts {given.get('num_prompts', '?')}, model "
          f"{given.get('model', '?')}, deploy {given.get('deploy_config', '?')}")  # fmt: skip
    if not saved.get("complete", True):
        left = saved.get("arms_left") or []
        if not isinstance(left, list):
            ap.error(f"--report {path}: not a run.py --json file (\"arms_left\" is {left!r}, not a list of arm "
                     "names)")  # fmt: skip
        print(f"incomplete: {saved.get('interrupted') or 'the run ended early'}; arms not run: "
              f"{', '.join(map(str, left)) or '-'}")  # fmt: skip
    try:
        print_table(arms)
        print_correctness(arms)
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # an arm's results of another shape
        ap.error(f"--report {path}: not a run.py --json file (an arm's results do not read: {type(e).__name__}: {e})")
    print(f"\nverdict when it ran: {'ok' if saved.get('ok') else 'FAILED'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser(__doc__, list(MODELS), DEFAULT_MODEL, sorted(RELEASES), WORK / "runs", deploy_names())
    args = ap.parse_args(argv)
    if args.report is not None:
        return report(ap, args)
    # SIGTERM / SIGHUP end this script as Ctrl-C does, through each arm's clean-up (the server's process group
    # stopped, its /dev/shm files checked): the default action left a running server behind.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupted)
    check_values(ap, args)  # numbers, lists, options that do nothing together; fills in the defaults
    check_outputs(ap, args)
    check_release(ap, args.release)
    if args.deploy_config is None:
        args.deploy_config = str(RELEASE.configs / "qwen3_omni_cpu.yaml")
    if args.kill_stage is not None:
        try:
            args.kill_stage = stage_number(args.kill_stage)
        except ValueError as e:
            ap.error(str(e))
    model_name = str(args.model)
    args.model = resolve_model(args.model)
    if not (args.model / "config.json").exists() and model_name in RELEASE.models:
        how = f"build_model.py --variant {model_name}"
        if RELEASE.name != "0.30":
            how = f"{VENV_BIN / 'python'} benchmarks/e2e/{how}"
        ap.error(
            f"--model {model_name}: no model at {args.model} (run {how} first; names: {', '.join(RELEASE.models)})"
        )
    if not (args.model / "config.json").is_file():
        what = ("is not a folder" if args.model.exists() and not args.model.is_dir() else
                "has no config.json, so it holds no model" if args.model.is_dir() else "does not exist")  # fmt: skip
        ap.error(
            f"--model {model_name}: {args.model} {what} (give a model folder, with its config.json, or a variant "
            f"name: {', '.join(RELEASE.models)}; build_model.py --out DIR builds a random-weight model there)"
        )
    deploy = resolve_deploy(args.deploy_config)
    if deploy is None:
        names = ", ".join(deploy_names()) or f"none in {RELEASE.configs} for --release {RELEASE.name}"
        said = "is a folder, not a deploy file" if Path(args.deploy_config).is_dir() else "no such file"
        ap.error(
            f"--deploy-config {args.deploy_config}: {said}, nor a NAME of "
            f"{RELEASE.configs.relative_to(HERE)}/qwen3_omni_cpu_NAME.yaml ({names})"
        )
    args.deploy_config = deploy
    try:
        arms = [make_arm(a.strip()) for a in args.arms.split(",") if a.strip()]
    except SystemExit as e:
        ap.error(str(e))
    if not arms:
        ap.error(f"--arms {args.arms!r}: no arm (e.g. off,qwen3-omni)")
    names = [a.name for a in arms]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        ap.error(f"--arms: {', '.join(twice)} given twice (to run an arm again on a server of its own, name it ARM#2)")
    folders = [arm_folder(n) for n in names]  # pol/a.yaml and pol_a.yaml: one folder, the second arm's logs over the first's
    if same := sorted({n for n, f in zip(names, folders) if folders.count(f) > 1}):
        ap.error(f"--arms: {' and '.join(same)} would share the run folder {arm_folder(same[0])!r}: give one of them "
                 "another name (a copy of its policy file, or ARM#2)")  # fmt: skip
    if args.hosts and RELEASE.name != "0.30":
        ap.error(f"--hosts {args.hosts}: the simulated hosts run vllm-omni 0.30.0's deploys (not --release {RELEASE.name})")
    if args.hosts and (HERE / "configs" / "qwen3_omni_cpu.yaml").resolve() == Path(args.deploy_config).resolve():
        args.deploy_config = HOSTS_DEPLOY.resolve()  # shared memory does not cross hosts
    for arm in arms:
        what = f"arm {arm.name}'s deploy" if arm.deploy else "--deploy-config"
        deploy_path = Path(arm.deploy or args.deploy_config)
        problem = check_deploy(deploy_path, RELEASE.name, args, what, probe_tokens(args.smoke))
        if problem:
            ap.error(problem)
    if args.capture:
        for arm in arms:
            if arm.env.get("OMNI_ACCUM_VLLM_OMNI") == "0":
                log(f"note: --capture: arm {arm.name} runs without omni-accum and records nothing")
    if args.hosts:
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
    if args.keep_logs:
        Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=args.work_dir))
    log(f"run folder {run_dir}")

    results: list[dict[str, Any]] = []

    def summary(say: Any = lambda _msg: None, **state: Any) -> dict[str, Any]:
        given = {k: str(v) for k, v in vars(args).items()}
        return {"ok": verdict(results, say), **state, "run_dir": str(run_dir), "args": given, "arms": results,
                "comparison": compare(results)}  # fmt: skip

    try:
        for arm in arms:
            results.append(run_arm(arm, args, run_dir))
            if args.json_out and len(results) < len(arms):
                write_json(args.json_out, summary(complete=False, arms_left=[a.name for a in arms[len(results):]]))
    except KeyboardInterrupt as e:  # Ctrl-C, and SIGTERM / SIGHUP (_interrupted; netns.Interrupted while a lab is open)
        why = str(e) or "Ctrl-C"
        log(f"interrupted ({why}): {len(results)} of {len(arms)} arms ended")
        if args.json_out:
            write_json(args.json_out, summary(complete=False, interrupted=why,
                                              arms_left=[a.name for a in arms[len(results):]]))  # fmt: skip
            log(f"wrote {args.json_out} (the arms that ended)")
        return 130
    print_table(results)
    print_correctness(results)
    done = summary(log, complete=True)
    if args.json_out:
        write_json(args.json_out, done)
        log(f"wrote {args.json_out}")
    return 0 if done["ok"] else 1

if __name__ == "__main__":
    sys.exit(main())
