"""run.py's options: the parser (each option with what it does and its default) and the checks that need only
the values given (numbers, output folders and files, options that do nothing together, what a deploy file
allows). What needs the release's environment, the model or omni-accum (the arms) run.py checks after these.
Every check runs before anything is started or written, and a bad value is a usage error: exit 2, one line
naming the option, the value and what it takes.
"""

from __future__ import annotations

import argparse
import math
import os
import textwrap
from pathlib import Path
from typing import Any

# The options whose default run.py fills in after the checks (None until then), so that a check can tell a value
# the user gave from the default. BENCH_ONLY: what only the benchmark client uses (nothing with --smoke).
DEFAULTS: dict[str, Any] = {
    "input_len": "8000", "output_len": 100, "concurrency": "1", "num_prompts": 0, "seed": 0, "duration_s": 0.0,
    "bench_timeout": 3600.0, "kill_after_s": 30.0, "warmup_s": 60.0,
}  # fmt: skip
BENCH_ONLY = ("input_len", "output_len", "concurrency", "num_prompts", "seed", "duration_s", "bench_timeout")
# seconds: (dest, smallest allowed, whether the smallest is allowed)
SECONDS = (
    ("start_timeout", 0, False), ("request_timeout", 0, False), ("bench_timeout", 0, False), ("stop_grace", 0, True),
    ("sample_every_s", 0, True), ("warmup_s", 0, True), ("duration_s", 0, True), ("kill_after_s", 0, True),
    ("idle_spin_s", 0, True),
)  # fmt: skip
COUNTS = (("output_len", 1), ("num_prompts", 0), ("seed", 0), ("smoke_max_tokens", 1), ("hosts", 0))


def option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def release_name(text: str) -> str:
    """``0.16.0`` -> ``0.16`` (setup_env.sh takes both); argparse's choices then check the result."""
    parts = str(text).strip().split(".")
    return ".".join(parts[:2]) if len(parts) == 3 and parts[2] == "0" else str(text).strip()


def a_path(text: str) -> Path:
    """An option's path; an empty one is refused (``Path('')`` is the current folder)."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError(f"{text!r} is an empty path (give a file or folder name)")
    return Path(text)


def build_parser(
    doc: str, models: list[str], default_model: str, releases: list[str], runs: Path, deploys: list[str] | None = None
) -> argparse.ArgumentParser:
    """Every option of run.py; ``doc``: run.py's docstring (its first paragraph is the description, its example
    commands and its last paragraph, the exit status, the epilog); ``deploys``: the deploy NAMEs."""
    parts = doc.strip().split("\n\n")
    head, examples, status = parts[0], parts[1], " ".join(parts[-1].split())
    ap = argparse.ArgumentParser(
        description=head,
        epilog="examples:\n" + examples + "\n\n" + textwrap.fill(status, 100) + "\n\nWhat a run writes, the models, "
        "the saved runs: benchmarks/e2e/README.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--arms",
        default="off,default,qwen3-omni",
        help="comma-separated: off (omni-accum turned off: vllm-omni's own code), a policy preset (default, "
        "qwen3-omni, qwen3-omni-flat) or a policy file; ARM@CONFIG runs ARM with another deploy config (a path, "
        "or NAME of configs/qwen3_omni_cpu_NAME.yaml, e.g. off@arena); ARM#N runs ARM again on a fresh server, "
        "named apart: off,qwen3-omni@arena,off#2 shows in off#2's ratios how far the machine drifted during the "
        "run. Each arm is checked before any server starts (default %(default)s)",
    )
    ap.add_argument(
        "--input-len",
        default=None,
        help="prompt tokens, comma-separated: the benchmark runs once per length on each arm's server; prompt "
        f"plus --output-len must fit the deploy's max_model_len (default {DEFAULTS['input_len']})",
    )
    ap.add_argument(
        "--output-len", type=int, default=None, help=f"tokens the thinker generates per request "
        f"(--random-output-len, --ignore-eos; default {DEFAULTS['output_len']})",
    )  # fmt: skip
    ap.add_argument(
        "--concurrency", default=None, help=f"requests in flight, comma-separated: the benchmark runs once per value "
        f"(default {DEFAULTS['concurrency']})",
    )  # fmt: skip
    ap.add_argument(
        "--num-prompts", type=int, default=None, help="requests per benchmark, at least the largest --concurrency "
        "(default: max(4, 2 x concurrency); with --duration-s 8 x concurrency per round)",
    )  # fmt: skip
    ap.add_argument(
        "--seed", type=int, default=None, help=f"benchmark dataset seed (default {DEFAULTS['seed']})"
    )  # fmt: skip
    ap.add_argument(
        "--json", dest="json_out", type=a_path, metavar="FILE", help="write every result here, rewritten after each "
        "arm (\"complete\": false until the last arm ends, or what had ended when the run was interrupted)",
    )  # fmt: skip
    ap.add_argument(
        "--report", type=a_path, metavar="FILE", help="print the tables and the probes' comparison of a run saved "
        "with --json FILE (e.g. one of benchmarks/e2e/results/runs/*.json) and exit: starts nothing, takes no other "
        "option",
    )  # fmt: skip
    ap.add_argument(
        "--keep-logs", type=a_path, metavar="DIR", help="copy each arm's server / client logs into DIR/ARM"
    )  # fmt: skip
    ap.add_argument(
        "--capture",
        type=a_path,
        metavar="DIR",
        help="record each arm's stream through omni-accum (OMNI_ACCUM_CAPTURE) into DIR/ARM, for `omni-accum trace "
        "DIR/ARM` and `omni-accum tune --trace DIR/ARM` (arms with omni-accum on only: an off arm records nothing)",
    )
    ap.add_argument(
        "--hosts",
        type=int,
        default=0,
        metavar="N",
        help="run each arm's server across N simulated hosts (network namespaces): the Mooncake master, "
        "the API server with stage 0, one per other stage (4 for Qwen3-Omni), over "
        "configs/qwen3_omni_cpu_mooncake.yaml in place of the default deploy. Needs root, ip (iproute2), network "
        "namespaces and Mooncake in the harness's virtualenv (checked before anything starts). 0: one host (default)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="one short chat request with audio per arm (the first probe only), no benchmark client (so none of "
        f"the benchmark's options: {', '.join(option(d) for d in BENCH_ONLY)})",
    )
    ap.add_argument(
        "--model",
        default=default_model,
        help=f"{', '.join(models)} (build_model.py --variant NAME's folder; tiny: 2 thinker layers; light: "
        "Qwen3-Omni's payload widths with little compute, the hand-off's share of latency near a GPU server's; "
        "lean: light with a quarter of its attention work) or a model folder (default %(default)s)",
    )
    ap.add_argument(
        "--deploy-config",
        default=None,
        help="a deploy YAML, or NAME of configs/qwen3_omni_cpu_NAME.yaml"
        + (f" ({', '.join(deploys)})" if deploys else "")
        + " (default configs/qwen3_omni_cpu.yaml; with --release 0.16 the stage configs of configs/0.16/)",
    )
    ap.add_argument(
        "--release",
        type=release_name,
        choices=releases,
        default=None,
        help="the vllm-omni release's server environment: its virtualenv (setup_env.sh --release NAME), its model "
        "folders (build_model.py run with that virtualenv's python) and its config format / folder "
        "(default: the release installed beside the python running this script, which must be 0.30's)",
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
    ap.add_argument(
        "--executor",
        choices=("mp", "uni"),
        default=None,
        help="every arm's server: vLLM's executor for each stage's one worker. uni: the model runner in the stage's "
        "engine core process, as vLLM picks on a GPU server with tensor parallel size 1, so that what the scheduler "
        "hands the runner (chunk 0: 66 MB at 8k, 262 MB at 32k) is not pickled through vLLM's message queue to a "
        "worker process (43 ms at 8k, 0.18-0.56 s at 32k on the 2-core VM, in every arm). mp: a worker process, "
        "which vLLM's CPU platform picks. Done by the harness's CPU platform package (OMNI_ACCUM_E2E_EXECUTOR), "
        "the same for every arm, off included; omni-accum plays no part. Default: vLLM's CPU platform's (mp)",
    )
    ap.add_argument(
        "--start-timeout", type=float, default=900.0, metavar="S",
        help="seconds each server may take to answer /health, also its stages' --stage-init-timeout "
        "(default %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--request-timeout", type=float, default=600.0, metavar="S",
        help="seconds each correctness probe (a chat request with audio) may take (default %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--bench-timeout", type=float, default=None, metavar="S",
        help=f"seconds one run of the benchmark client may take (default {DEFAULTS['bench_timeout']})",
    )  # fmt: skip
    ap.add_argument(
        "--stop-grace", type=float, default=60.0, metavar="S",
        help="seconds after SIGTERM to the server's processes before SIGKILL (default %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--smoke-max-tokens", type=int, default=16, metavar="N",
        help="the thinker's max_tokens in each correctness probe (default %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--work-dir", type=a_path, default=runs, metavar="DIR",
        help="a folder per run under it: each arm's logs, status files, metrics, benchmark results "
        "(default benchmarks/e2e/.work/runs)",
    )  # fmt: skip
    ap.add_argument(
        "--sample-every-s",
        type=float,
        default=5.0,
        metavar="S",
        help="while an arm's server runs, record every S seconds the RSS of each server process (VmRSS), the bytes "
        "in omni-accum's private folder (/dev/shm/omni-accum-<euid>/) and the bytes in use on /dev/shm, into "
        "<run>/<arm>/memory.csv and memory.json, and plot them to memory.png (needs matplotlib; without it the "
        "data only, and the report says so). 0: off (default %(default)s)",
    )
    ap.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        metavar="S",
        help="samples before this many seconds after the server was ready are left out of the flatness verdict "
        "(memory.json 'flat': each series' growth from its first to its last quarter; needs the samples, "
        f"--sample-every-s more than 0; default {DEFAULTS['warmup_s']:g})",
    )
    ap.add_argument(
        "--duration-s",
        type=float,
        default=None,
        metavar="S",
        help="hold each concurrency at least this long: the benchmark client runs again and again (rounds of "
        "8 x C prompts unless --num-prompts, the seed + 1 per round) until the time is up; the JSON has every "
        "round, the requests sent / answered / failed with their errors, and omni-accum's fallbacks from "
        "/metrics by reason; the table's client rows are the first round's. 0: one run (default)",
    )
    ap.add_argument(
        "--kill-stage",
        default=None,
        metavar="STAGE",
        help="fault injection: SIGKILL this stage's engine-core process (thinker, talker, code2wav, or a stage "
        "number of the deploy) --kill-after-s after the first benchmark starts, then record what the server did "
        "(still running, /health, the stage restarted or not, new processes, the client's errors, the server log's "
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
        default=None,
        metavar="S",
        help="seconds after the first benchmark starts, for --kill-stage and --hosts-fault (default "
        f"{DEFAULTS['kill_after_s']:g})",
    )
    return ap


def check_values(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Numbers in range, options that do nothing together; then the defaults of :data:`DEFAULTS` filled in."""
    given = {k for k in DEFAULTS if getattr(args, k) is not None}
    for dest, low, inclusive in SECONDS:
        v = getattr(args, dest)
        if v is None:
            continue
        if not math.isfinite(v):
            ap.error(f"{option(dest)}: {v} is not a number of seconds (a finite number, "
                     f"{f'{low} or more' if inclusive else f'more than {low}'})")  # fmt: skip
        if v < low or (v == low and not inclusive):
            ap.error(f"{option(dest)}: {v:g} is {'negative' if v < 0 else 'not more than 0'} (seconds, "
                     f"{'0 or more' if inclusive else 'more than 0'})")  # fmt: skip
    for dest, low in COUNTS:
        v = getattr(args, dest)
        if v is not None and v < low:
            ap.error(f"{option(dest)}: {v} is below {low} (a whole number, {low} or more)")
    if args.smoke and given & set(BENCH_ONLY):
        named = ", ".join(option(d) for d in BENCH_ONLY if d in given)
        ap.error(f"--smoke runs no benchmark, so {named} would do nothing: drop {'them' if ',' in named else 'it'} "
                 "or --smoke")  # fmt: skip
    if "warmup_s" in given and args.sample_every_s == 0:
        ap.error(f"--warmup-s {args.warmup_s:g}: times the memory samples' flatness verdict, and --sample-every-s 0 "
                 "takes no samples: drop --warmup-s, or give --sample-every-s more than 0")  # fmt: skip
    if "kill_after_s" in given and args.kill_stage is None and args.hosts_fault is None:
        ap.error(f"--kill-after-s {args.kill_after_s:g}: times --kill-stage or --hosts-fault, and neither is given")
    if args.kill_stage is not None and args.smoke:
        ap.error("--kill-stage needs the benchmark (it kills the stage while the benchmark runs): drop --smoke")
    if args.hosts_fault is not None and (not args.hosts or args.smoke):
        ap.error(f"--hosts-fault {args.hosts_fault}: needs --hosts N and the benchmark (not --smoke)")
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        args.concurrency = positive_ints(args.concurrency, "--concurrency")
        args.input_len = positive_ints(args.input_len, "--input-len")
    except ValueError as e:
        ap.error(str(e))
    # A benchmark of fewer requests than its concurrency never has that many in flight (its results would be
    # labelled with a concurrency it did not reach).
    if args.num_prompts and not args.smoke and args.num_prompts < max(args.concurrency):
        ap.error(f"--num-prompts {args.num_prompts} is below --concurrency {max(args.concurrency)}: that many "
                 f"requests are never in flight (give at least {max(args.concurrency)}, or leave it out)")  # fmt: skip


def positive_ints(text: str, flag: str) -> list[int]:
    """``8000,16000,32000`` -> [8000, 16000, 32000]; ValueError naming the option and the bad item."""
    out = []
    for t in (t.strip() for t in str(text).split(",")):
        if not (t.isascii() and t.isdigit()) or int(t) <= 0:
            example = "8000,32000" if flag == "--input-len" else "1,4"
            raise ValueError(f"{flag}: {t!r} in {text!r} is not a positive integer (a comma-separated list, e.g. "
                             f"{example})")  # fmt: skip
        if int(t) in out:
            raise ValueError(f"{flag}: {int(t)} is given twice in {text!r} (each value runs once; the second run "
                             "would overwrite the first's results)")  # fmt: skip
        out.append(int(t))
    return out


def _writable_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be (or be made) a folder this script writes into; None when it can."""
    if path.exists():
        if not path.is_dir():
            return f"{path} exists and is not a folder"
        return None if os.access(path, os.W_OK | os.X_OK) else f"{path} is not writable"
    up = path.parent
    while not up.exists() and up != up.parent:
        up = up.parent
    if not up.is_dir():
        return f"{up} is not a folder, so {path} cannot be made"
    return None if os.access(up, os.W_OK | os.X_OK) else f"{up} is not writable, so {path} cannot be made"


def check_outputs(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every folder and file the run writes can be written, before the first server starts (a run of hours that
    ended in a traceback on its --json lost its results)."""
    for dest in ("work_dir", "keep_logs", "capture"):
        path = getattr(args, dest)
        why = path is not None and _writable_dir_problem(Path(path))
        if why:
            ap.error(f"{option(dest)} {path}: {why} (give a folder)")
    if args.json_out is not None:
        path = Path(args.json_out)
        if path.is_dir():
            ap.error(f"--json {path}: is a folder (give a file name, e.g. {path / 'e2e.json'})")
        if path.exists() and not path.is_file():
            ap.error(f"--json {path}: exists and is not a regular file")
        why = _writable_dir_problem(path.parent)
        if why:
            ap.error(f"--json {path}: {why}")


def stage_id_of(stage: dict, index: int, where: str) -> int:
    """A deploy stage's ``stage_id`` (its place in the list when it names none, as vllm-omni numbers them);
    ValueError naming ``where`` (the file and the stage), the key and the value when it is not a whole number."""
    v = stage.get("stage_id", index)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{where}: stage_id {v!r} is not a stage number (a whole number, 0 or more)")
    return v


def read_deploy(path: Path) -> tuple[str, dict[int, int | None]]:
    """A deploy file's release format (``0.30``: ``stages:``; ``0.16``: ``stage_args:``) and its stages: stage id
    -> ``max_model_len`` (None where it sets none); ValueError naming the file (and the stage and the key) when it
    is neither, or a stage's ``stage_id`` or ``max_model_len`` is not a number."""
    import yaml

    if path.is_dir():
        raise ValueError(f"{path}: is a folder, not a deploy file")
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1}: {getattr(e, 'problem', None) or 'here'})" if mark else ""
        raise ValueError(f"{path}: not a YAML file{where}") from e
    if not isinstance(data, dict) or not isinstance(data.get("stages", data.get("stage_args")), list):
        raise ValueError(f"{path}: neither a vllm-omni 0.30 deploy (stages:) nor 0.16 stage configs (stage_args:)")
    fmt, key = ("0.30", "stages") if "stages" in data else ("0.16", "stage_args")
    if not data[key]:
        raise ValueError(f"{path}: {key} is empty (give the deploy's stages, stage 0 first)")
    stages: dict[int, int | None] = {}
    for i, s in enumerate(data[key]):
        if not isinstance(s, dict):
            raise ValueError(f"{path}: {key}[{i}] is {s!r}, not a mapping (stage_id:, max_model_len:, ...)")
        sid = stage_id_of(s, i, f"{path}: {key}[{i}]")
        if sid in stages:
            raise ValueError(f"{path}: {key}[{i}]: stage_id {sid} is given twice")
        engine = s.get("engine_args") if fmt == "0.16" and isinstance(s.get("engine_args"), dict) else s
        limit = engine.get("max_model_len")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0) and limit != -1:
            where = "engine_args.max_model_len" if engine is not s else "max_model_len"
            raise ValueError(f"{path}: stage {sid}: {where} {limit!r} is not a number of tokens (a whole number, "
                             "more than 0, or -1: vLLM fits it to the memory)")  # fmt: skip
        stages[sid] = None if limit == -1 else limit  # -1: vLLM's own fit, no limit the harness can check
    return fmt, stages


def check_deploy(path: Path, release: str, args: argparse.Namespace, what: str, prompt_tokens: int = 0) -> str | None:
    """What in ``args`` the deploy at ``path`` cannot run (``what``: where it was named, for the message;
    ``prompt_tokens``: at most how many tokens a correctness probe's prompt takes, beside --smoke-max-tokens)."""
    try:
        fmt, stages = read_deploy(path)
    except ValueError as e:
        return f"{what}: {e}"
    if fmt != release:
        fix = "run it with --release 0.16" if fmt == "0.16" else "give one of configs/0.16/ (stage_args:)"
        return f"{what}: {path} is vllm-omni {fmt}'s format and this run starts a {release} server: {fix}"
    if args.kill_stage is not None and args.kill_stage not in stages:
        return f"--kill-stage {args.kill_stage}: {what} has no stage {args.kill_stage} (stages {sorted(stages)})"
    limit = stages.get(0)
    probe = prompt_tokens + args.smoke_max_tokens
    if limit and probe > limit:
        return (f"--smoke-max-tokens {args.smoke_max_tokens} + a correctness probe's prompt (up to {prompt_tokens} "
                f"tokens) = {probe} tokens exceed {what}'s max_model_len {limit} (stage 0 of {path.name})")  # fmt: skip
    if limit and not args.smoke:
        longest = max(args.input_len) + args.output_len
        if longest > limit:
            return (f"--input-len {max(args.input_len)} + --output-len {args.output_len} = {longest} tokens exceed "
                    f"{what}'s max_model_len {limit} (stage 0 of {path.name})")  # fmt: skip
    talker = stages.get(1)  # its prefill is the thinker's prompt, one row more (chunk 0's [P+1, hidden] rows)
    if talker and not args.smoke and max(args.input_len) + 1 > talker:
        return (f"--input-len {max(args.input_len)}: the talker's prefill takes {max(args.input_len) + 1} rows (the "
                f"prompt and one more), over {what}'s max_model_len {talker} of stage 1 ({path.name})")  # fmt: skip
    return None
