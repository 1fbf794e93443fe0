"""Chunked prefill through vllm-omni's own Qwen3-Omni stage input processor: 0.30.0's code against omni-accum.

``thinker2talker_async_chunk`` (the async-chunk thinker-to-talker processor) is called as the thinker
adapter's save loop calls it: one call per prefill chunk, then the first decode step, which hands the
payload over. Arms, interleaved round by round in one process, each on a real ``OmniChunkTransferAdapter``
(SharedMemoryConnector) as ``transfer_manager``:

* ``off``: vllm-omni's own function (what ``OMNI_ACCUM_VLLM_OMNI=0`` runs): ``torch.cat`` of both tensors
  again for every chunk;
* ``default``: omni-accum installed under the ``default`` policy (``cat``: the release's own function,
  timed by the hook);
* ``qwen3-omni``: the preset's ``prealloc`` (one buffer of the prompt's rows + 1, each chunk copied once).

Printed per prompt length: the median time per request spent in the processor over its prefill chunks (the
sum of its calls), the ratio to ``off``, and the bytes copied (``omni_accum_processor_bytes_copied_total``).
Every arm's payload is checked equal to ``off``'s, bit for bit.

    .venv/bin/python benchmarks/processor_prefill.py                 # 8k and 32k prompts, 2048-token chunks
    .venv/bin/python benchmarks/processor_prefill.py --lengths 16384 --chunk 1024 --rounds 7

Each arm first runs ``--warmup`` untimed requests (default 1): a process's first requests of a size fault in
fresh pages, which at 8k made a 5-round median (no warm-up) read ``default`` up to 1.9x of ``off`` and ``qwen3-omni`` 0.66x,
against 1.0x and 0.1x once warm.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

D = 2048  # Qwen3-Omni's thinker hidden size
T2T = "vllm_omni.model_executor.stage_input_processors.qwen3_omni.thinker2talker_async_chunk"
ARMS = ("off", "default", "qwen3-omni")


def _adapter(policy: str | None) -> Any:
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter,
    )

    extra = {"stage_id": 0, "omni_accum_policy": policy or "off"}
    mc = SimpleNamespace(
        worker_type="ar",
        max_num_seqs=8,
        stage_id=0,
        async_chunk=True,
        stage_connector_config={"name": "SharedMemoryConnector", "extra": extra},
        custom_process_next_stage_input_func=T2T,
        hf_config=SimpleNamespace(talker_config=SimpleNamespace(accept_hidden_layer=24)),
    )
    return OmniChunkTransferAdapter(SimpleNamespace(model_config=mc, scheduler_config=SimpleNamespace(max_num_seqs=8)))


def _steps(prompt_len: int, chunk: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    sizes = [min(chunk, prompt_len - s) for s in range(0, prompt_len, chunk)] + [1]  # then the first decode row
    consts = {k: torch.randn(1, 1, D, generator=g).bfloat16() for k in ("tts_bos", "tts_eos", "tts_pad")}
    steps = []
    for n in sizes:
        layers = {0: torch.randn(n, D, generator=g).bfloat16(), 24: torch.randn(n, D, generator=g).bfloat16()}
        steps.append({"hidden_states": {"layers": layers}, "embed": consts})
    return steps


def _request(rid: str, prompt_len: int, decoding: bool) -> Any:
    prompt = [100 + i % 1000 for i in range(prompt_len)]
    out = [7] if decoding else []
    return SimpleNamespace(
        request_id="int-" + rid,
        external_req_id=rid,
        prompt_token_ids=prompt,
        output_token_ids=out,
        all_token_ids=prompt + out,
        additional_information=None,
        resumable=False,
        num_computed_tokens=0,
    )


def one_request(fn: Any, tx: Any, rid: str, steps: list[dict], prompt_len: int) -> tuple[float, Any]:
    """Seconds spent in the processor over one request's calls, and the payload it handed over."""
    reqs = [_request(rid, prompt_len, i == len(steps) - 1) for i in range(len(steps))]
    spent, out = 0.0, None
    for mm, req in zip(steps, reqs):
        t0 = time.perf_counter()
        out = fn(tx, mm, req, False)
        spent += time.perf_counter() - t0
    tx.put_req_chunk.pop(rid, None)
    tx.request_payload.pop(rid, None)
    return spent, out


def _copied(strategy: str) -> float:
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return float("nan")
    return REGISTRY.get_sample_value("omni_accum_processor_bytes_copied_total", {"strategy": strategy}) or 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="8192,32768", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--rounds", type=int, default=9, help="requests per arm (arms interleaved)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed requests per arm first (the first ones fault in fresh pages and read as slower)")
    args = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        if not lengths or min(lengths) < 1 or args.chunk < 1 or args.rounds < 1 or args.warmup < 0:
            raise ValueError
    except ValueError:
        print(f"processor_prefill: --lengths {args.lengths!r}, --chunk {args.chunk}, --rounds {args.rounds}, "
              f"--warmup {args.warmup}: give whole numbers >= 1 (--warmup >= 0; lengths comma-separated)",
              file=sys.stderr)
        return 2

    from omni_accum.integrations import vllm_omni as integration

    integration.install(None)  # the wrappers; each adapter's policy comes from its connector extra
    txs = {"off": _adapter(None), "default": _adapter("default"), "qwen3-omni": _adapter("qwen3-omni")}
    fns = {arm: tx.custom_process_next_stage_input_func for arm, tx in txs.items()}
    fns["off"] = fns["off"].__omni_accum_original__  # vllm-omni's own function, no hook at all
    label = {"off": None, "default": "cat", "qwen3-omni": "prealloc"}
    print(f"vllm-omni's thinker2talker_async_chunk, chunked prefill in {args.chunk}-token chunks, "
          f"{args.rounds} requests per arm (median) after {args.warmup} untimed, [rows, {D}] bf16 x 2 keys")
    print(f"{'prompt':>7} {'chunks':>6} {'arm':>11} {'s/request':>10} {'vs off':>7} {'GB copied/request':>18}")
    try:
        for n in lengths:
            steps = _steps(n, args.chunk)
            times: dict[str, list[float]] = {a: [] for a in ARMS}
            copied: dict[str, float] = {}
            ref = None
            for r in range(args.warmup):
                for arm in ARMS:
                    one_request(fns[arm], txs[arm], f"{arm}-{n}-warm{r}", steps, n)
            for r in range(args.rounds):
                order = ARMS if r % 2 == 0 else tuple(reversed(ARMS))
                for arm in order:
                    before = _copied(label[arm]) if label[arm] else 0.0
                    spent, out = one_request(fns[arm], txs[arm], f"{arm}-{n}-{r}", steps, n)
                    times[arm].append(spent)
                    if label[arm]:
                        copied[arm] = _copied(label[arm]) - before
                    if arm == "off" and ref is None:
                        ref = out
                    elif ref is not None and not (
                        torch.equal(out.embed.prefill, ref.embed.prefill)
                        and torch.equal(out.hidden_states.output, ref.hidden_states.output)
                    ):
                        print(f"processor_prefill: arm {arm} handed over other tensors than off", file=sys.stderr)
                        return 1
                    del out
            rows = [int(mm["hidden_states"]["layers"][0].shape[0]) for mm in steps]
            held = [sum(rows[: k + 1]) for k in range(1, len(rows))]  # what each of 0.30.0's torch.cat writes
            copied["off"] = 2 * 2 * D * sum(held)  # two keys, bf16
            base = statistics.median(times["off"])
            for arm in ARMS:
                med = statistics.median(times[arm])
                gb = copied[arm] / 1e9
                print(f"{n:>7} {len(steps) - 1:>6} {arm:>11} {med:>10.4f} {med / base:>7.3f} {gb:>18.3f}")
    finally:
        for tx in txs.values():
            tx.shutdown()
            tx.connector.close()
        integration.uninstall()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
