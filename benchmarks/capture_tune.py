"""``tune --trace`` on a synthetic capture of a few minutes of vllm-omni 0.30.0's thinker -> talker traffic.

    .venv/bin/python benchmarks/capture_tune.py [--minutes 5] [--out /tmp/capture-tune]

Writes the capture with omni-accum's own recorder (what the send hook writes: chunk 0 the prefill hand-off,
[P+1, 2048] bf16 ``embed.prefill`` / ``hidden_states.output``, the three tts embeddings and the ids; then one
``embed.decode`` row per step and the two flags; a request every 2 s, prompts of 1k to 8k tokens, 100 to 300
decode steps 40 ms apart: up to ~6 requests at once), prints ``omni-accum trace`` of it, then runs
``omni-accum tune --trace`` on it and prints how long that took (the target: <= 60 s for 5 minutes).
A benchmark, not a test: it asserts nothing and is not collected by pytest.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path

import torch


def write_capture(folder: Path, minutes: float, seed: int = 0) -> int:
    """A synthetic capture in ``folder``; returns the number of records."""
    from omni_accum.capture import CaptureWriter, ChunkRecorder

    rnd = random.Random(seed)
    w = CaptureWriter(folder, "0")

    def kind_of(path: str, value: object) -> tuple[str, str]:
        append = isinstance(value, torch.Tensor) and value.dim() > 0 and path in APPEND
        return ("append", "cat") if append else ("replace", "replace" if path == "meta.finished" else "cat")

    rec = ChunkRecorder(w, "send", "0->1", kind_of, ctx_of=lambda p: p)
    row = torch.zeros(1, 2048, dtype=torch.bfloat16)
    const = torch.zeros(1, 1, 2048, dtype=torch.bfloat16)
    flag = torch.tensor(False)
    events = []  # (t_us, request, step)
    t = 0
    n_req = 0
    while t < minutes * 60e6:
        p = rnd.choice((1000, 2000, 4000, 8000))
        steps = rnd.randint(100, 300)
        events += [(t + s * 40_000, n_req, s, p, steps) for s in range(steps + 1)]
        n_req += 1
        t += 2_000_000
    events.sort()
    prefills: dict[int, torch.Tensor] = {}
    for t_us, r, s, p, _ in events:
        if s == 0:
            pre = prefills.get(p)
            if pre is None:
                pre = prefills[p] = torch.zeros(p + 1, 2048, dtype=torch.bfloat16)
            chunk = {
                "embed": {"prefill": pre, "tts_bos": const, "tts_eos": const, "tts_pad": const},
                "hidden_states": {"output": pre},
                "ids": {"all": list(range(p + 1)), "prompt": list(range(p))},
                "meta": {"finished": flag, "is_segment_finished": flag},
            }
        else:
            chunk = {"embed": {"decode": row}, "meta": {"finished": flag, "is_segment_finished": flag}}
        rec.record(f"req-{r}", chunk, 1_000_000_000 + t_us, source=p if s == 0 else None)
    w.close()
    return len(events)


APPEND = ("embed.prefill", "hidden_states.output", "embed.decode")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/capture-tune"))
    ap.add_argument("--quick", action="store_true", help="tune --quick")
    args = ap.parse_args()
    folder = args.out / "capture"
    if folder.exists():
        for f in folder.iterdir():
            f.unlink()
    n = write_capture(folder, args.minutes)
    print(f"wrote {n} records of {args.minutes:g} minutes to {folder}")
    cli = [sys.executable, "-m", "omni_accum.cli"]
    subprocess.run([*cli, "trace", str(folder)], check=True)
    out = args.out / "tuned.yaml"
    cmd = [*cli, "tune", "--trace", str(folder), "--out", str(out), *(["--quick"] if args.quick else [])]
    t0 = time.monotonic()
    r = subprocess.run(cmd)
    print(f"\n{' '.join(cmd[2:])}: exit {r.returncode} in {time.monotonic() - t0:.1f} s (target: <= 60 s)")


if __name__ == "__main__":
    main()
