"""What a vllm-omni 0.16.0 talker pays per decode step to get its ``thinker_embeddings``, in one run, per arm.

    benchmarks/e2e/.work/venv-016/bin/python benchmarks/talker_step_016.py --rows 8000 --steps 100 --repeats 3
    (or .venv-016/bin/python: any environment with vllm-omni 0.16.0)

One talker request on 0.16.0's real ``OmniChunkTransferAdapter`` (AR stage 1, its loops stopped): chunk 0 (the
prefill ``[P+1, 2048]`` bf16 with the statics, as 0.16.0's ``thinker2talker_async_chunk`` sends it), then one
``[1, 2048]`` row and ``finished`` per decode step. A step is what the scheduler process and the worker do with
it: the adapter's ``_update_request_payload`` (the receive), the scheduler's ``postprocess_scheduler_output``
(which attaches the request's whole accumulated dict to the step's output), the ``mp`` executor's crossing
(vLLM's ``MessageQueue.enqueue``: ``pickle.dumps`` with protocol 5 and buffers of 1 MiB or more out of band,
their bytes copied into the queue, and the reader's ``pickle.loads``) and 0.16.0's
``OmniGPUModelRunner._update_request_information``. The arms: ``off`` (0.16.0's own methods), ``default``
(omni-accum installed, ``cat``: 0.16.0's values and bytes) and ``qwen3-omni`` (``prealloc`` and the rows-only
crossing). Every arm's last step is checked bit for bit against the ``torch.cat`` of the chunks. Medians per
step over the decode steps, then the median over repeats (arms interleaved, rotating order); read the ratios.
The talker's own model step (hundreds of ms on a CPU, a few on a GPU) is not in it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

ARMS = ("off", "default", "qwen3-omni")
H = 2048
_clock = time.perf_counter_ns


def stream(rows: int, steps: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(rows)
    bf = lambda *s: torch.randn(*s, generator=g).bfloat16()  # noqa: E731
    first = {
        "thinker_embeddings": bf(rows + 1, H), "thinker_hidden_states": bf(rows + 1, H),
        "thinker_sequences": list(range(rows + 1)), "thinker_input_ids": list(range(rows)),
        "tts_bos_embed": bf(1, H), "tts_eos_embed": bf(1, H), "tts_pad_embed": bf(1, H),
        "finished": torch.tensor(False),
    }  # fmt: skip
    return [first] + [{"thinker_embeddings": bf(1, H), "finished": torch.tensor(i == steps - 1)} for i in range(steps)]


def adapter(policy: str | None) -> Any:
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import OmniChunkTransferAdapter

    extra = {"stage_id": 1, **({"omni_accum_policy": policy} if policy else {})}
    mc = SimpleNamespace(stage_connector_config={"name": "SharedMemoryConnector", "extra": extra}, worker_type="ar",
                         custom_process_next_stage_input_func=None)  # fmt: skip
    cfg = SimpleNamespace(model_config=mc, scheduler_config=SimpleNamespace(max_num_seqs=4),
                          parallel_config=SimpleNamespace(distributed_executor_backend="mp"))  # fmt: skip
    a = OmniChunkTransferAdapter(cfg)
    a.stop_event.set()
    return a


def cross(obj: Any) -> Any:
    """vLLM 0.16.0's ``MessageQueue.enqueue`` / ``dequeue`` in one process (the bytes copied once into the queue)."""
    from _message_queue import through_message_queue  # noqa: PLC0415 - beside this script

    return through_message_queue(obj, reuse=False)[0]


def scheduled(new: bool, request: Any) -> Any:
    from vllm_omni.core.sched.output import OmniCachedRequestData, OmniNewRequestData

    empty = dict(new_token_ids=[], all_token_ids={}, new_block_ids=[], num_computed_tokens=[], num_output_tokens=[])
    if new:
        nr = OmniNewRequestData(req_id="r", external_req_id="r", prompt_token_ids=[0], mm_features=[],
                                sampling_params=None, pooling_params=None, block_ids=([0],), num_computed_tokens=0,
                                lora_request=None, prompt_embeds=None,
                                additional_information=request.additional_information)  # fmt: skip
        return SimpleNamespace(scheduled_new_reqs=[nr], scheduled_cached_reqs=OmniCachedRequestData(
            req_ids=[], resumed_req_ids=set(), prompt_token_ids={}, **empty))
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=OmniCachedRequestData(
        req_ids=["r"], resumed_req_ids=set(), prompt_token_ids={}, **empty))  # fmt: skip


def one_request(arm: str, chunks: list[dict[str, Any]]) -> tuple[list[int], torch.Tensor]:
    """Per decode step, the nanoseconds of receive + attach + crossing + the runner's update; the model's view."""
    from vllm_omni.worker.gpu_model_runner import OmniGPUModelRunner

    import omni_accum.integrations.vllm_omni as vo

    if arm == "off":
        vo.uninstall()
    else:
        vo.install(arm)
    a = adapter(None if arm == "off" else arm)
    request = SimpleNamespace(request_id="r", additional_information=None)
    runner = SimpleNamespace(requests={"r": SimpleNamespace(additional_information_cpu=None)})
    times = []
    for k, chunk in enumerate(chunks):
        payload = dict(chunk)
        t0 = _clock()
        a._update_request_payload("r", payload)
        request.additional_information = payload
        so = scheduled(k == 0, request)
        a.postprocess_scheduler_output(so, {"r": request})
        seen = cross(so)
        if k == 0:
            runner.requests["r"].additional_information_cpu = seen.scheduled_new_reqs[0].additional_information
        else:
            OmniGPUModelRunner._update_request_information(runner, "r", seen.scheduled_cached_reqs.additional_information["r"])
        t1 = _clock()
        if k:
            times.append(t1 - t0)
    a.cleanup("r")
    return times, runner.requests["r"].additional_information_cpu["thinker_embeddings"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8000, help="prompt length P (default 8000)")
    ap.add_argument("--steps", type=int, default=100, help="decode steps per request (default 100)")
    ap.add_argument("--repeats", type=int, default=3, help="requests per arm (default 3)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if min(args.rows, args.steps, args.repeats) < 1:
        ap.error("--rows, --steps and --repeats must be at least 1")
    from importlib.metadata import version

    if not version("vllm-omni").startswith("0.16."):
        print(f"needs vllm-omni 0.16.0, found {version('vllm-omni')} (run it with .venv-016/bin/python)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    chunks = stream(args.rows, args.steps)
    reference = torch.cat([c["thinker_embeddings"] for c in chunks])
    per_arm: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(args.repeats + 1):  # round 0: warm-up
        order = ARMS[r % len(ARMS):] + ARMS[: r % len(ARMS)]
        for arm in order:
            times, view = one_request(arm, chunks)
            if not torch.equal(view.view(torch.int16), reference.view(torch.int16)):
                print(f"{arm}: the runner's thinker_embeddings differ from the torch.cat reference", file=sys.stderr)
                return 1
            if r:
                per_arm[arm].append(statistics.median(times) / 1e6)
    med = {arm: statistics.median(v) for arm, v in per_arm.items()}
    print(f"vllm-omni 0.16.0 talker, P={args.rows}, {args.steps} decode steps, {args.repeats} requests per arm")
    print(f"{'arm':<12} {'ms per step':>12} {'ratio to off':>13}")
    for arm in ARMS:
        print(f"{arm:<12} {med[arm]:>12.2f} {med[arm] / med['off']:>12.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": args.rows, "steps": args.steps, "repeats": args.repeats, "ms_per_step": med,
                       "runs": per_arm}, fh, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
