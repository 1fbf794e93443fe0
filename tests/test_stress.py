"""Load: 8 threads x 1000 requests of concurrent encode / merge / release on one shared Sender and Receiver.

Each thread keeps three requests in flight, interleaving their chunks, so a release of one request
always happens while the other threads (and this thread's other requests) merge. Every other
request is merged with sequence numbers and its chunks shuffled inside the reorder window, with a
duplicate thrown in, so the sequenced path runs under contention too. Every view is checked
against the reference after every chunk. Figures are in docs/reliability.md.
"""

from __future__ import annotations

import random
import threading

import torch

import omni_accum
from omni_accum.testing import same_bits

THREADS = 8
REQUESTS_PER_THREAD = 1000
IN_FLIGHT = 3
DECODE_STEPS = 4
H = 8


def _stream(tid: int, r: int) -> list[dict]:
    """A small Qwen3-Omni thinker -> talker stream: prefill chunk, then decode rows."""
    g = torch.Generator().manual_seed(tid * 100_003 + r)
    p = 1 + (r % 5)
    bos = torch.full((1, 1, H), float(tid)).bfloat16()
    chunks = [
        {
            "embed": {"prefill": torch.randn(p, H, generator=g).bfloat16(), "tts_bos": bos},
            "hidden_states": {"output": torch.randn(p, H, generator=g).bfloat16()},
            "ids": {"prompt": list(range(r % 7 + 1))},
            "speaker": f"spk{tid}",
            "meta": {"finished": torch.tensor(False)},
        }
    ]
    for s in range(DECODE_STEPS):
        chunks.append(
            {
                "embed": {"decode": torch.randn(1, H, generator=g).bfloat16(), "tts_bos": bos},
                "ids": {"prompt": list(range(r % 7 + 1))},
                "speaker": f"spk{tid}",
                "meta": {"finished": torch.tensor(s == DECODE_STEPS - 1)},
            }
        )
    return chunks


def _check(view, chunks: list[dict], upto: int, tid: int) -> None:
    """The view after chunks 0..upto equals the reference."""
    first = chunks[0]
    assert same_bits(view["embed"]["prefill"], first["embed"]["prefill"])
    assert same_bits(view["hidden_states"]["output"], first["hidden_states"]["output"])
    assert same_bits(view["embed"]["tts_bos"], first["embed"]["tts_bos"])
    assert view["speaker"] == f"spk{tid}" and view["ids"]["prompt"] == first["ids"]["prompt"]
    if upto >= 1:
        rows = torch.cat([c["embed"]["decode"] for c in chunks[1 : upto + 1]])
        assert same_bits(view["embed"]["decode"], rows)
    assert bool(view["meta"]["finished"]) is (upto == DECODE_STEPS)


def test_eight_threads_thousand_requests_each():
    policy = omni_accum.load_policy("qwen3-omni")
    tx, rx = omni_accum.Sender(policy), omni_accum.Receiver(policy, reorder_window=4)
    errors: list[BaseException] = []
    done = [0] * THREADS
    dups = [0] * THREADS

    def worker(tid: int) -> None:
        rnd = random.Random(tid)
        try:
            todo = list(range(REQUESTS_PER_THREAD))
            flight: list[list] = []  # [rid, chunks, wires, next chunk to send, sequenced]
            while todo or flight:
                while todo and len(flight) < IN_FLIGHT:
                    r = todo.pop()
                    flight.append([f"t{tid}-r{r}", _stream(tid, r), [], 0, r % 2 == 0])
                job = flight[rnd.randrange(len(flight))]
                rid, chunks, wires, i, sequenced = job
                if not sequenced:
                    view = rx.merge(rid, tx.encode(rid, chunks[i]))
                    _check(view, chunks, i, tid)
                    job[3] = i + 1
                else:
                    # encode the whole stream in order, deliver it shuffled in windows of 3, with a duplicate
                    wires = [(s, tx.encode(rid, c)) for s, c in enumerate(chunks)]
                    order = []
                    for w in range(0, len(wires), 3):
                        block = wires[w : w + 3]
                        rnd.shuffle(block)
                        order += block
                    order.insert(rnd.randrange(1, len(order)), order[0])
                    for s, w in order:
                        view = rx.merge(rid, w, seq=s)
                    dups[tid] += 1
                    _check(rx.finish(rid, chunks=len(chunks)), chunks, DECODE_STEPS, tid)
                    job[3] = len(chunks)
                if job[3] == len(chunks):
                    flight.remove(job)
                    assert tx.release(rid) and rx.release(rid)
                    done[tid] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a worker thread never finished (deadlock?)"
    assert not errors, repr(errors[0])
    assert sum(done) == THREADS * REQUESTS_PER_THREAD
    assert rx.active_requests == 0 and tx.active_requests == 0
    assert rx.duplicates_dropped == sum(dups)
