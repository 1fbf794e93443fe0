"""The built-in workloads (``omni-accum bench --workload NAME``): Qwen3-Omni's chunk traffic.

Each preset is the mapping a workload file would hold (without ``name``); see
:mod:`omni_accum.bench.workloads` for the schema. The shapes are those of Qwen3-Omni's thinker -> talker ->
code2wav payloads in vllm-omni (hidden size 2048: a ``[P+1, 2048]`` prefill embedding, then one row per decode
step); each preset's ``description`` says which key layout (release) and traffic it models.
:data:`DEFAULT_WORKLOAD` (``qwen3-omni-0.30``) is what vllm-omni 0.30.0 sends; ``qwen3-omni-seed`` is the
0.16-era flat-key stream, kept for older releases.
"""

from __future__ import annotations

from typing import Any

_STATIC_TTS = [1, 2048]  # a [1, 1, 2048] constant is one row of [1, 2048]

#: The default workload of ``omni-accum tune`` and ``omni-accum bench`` (and the main job).
DEFAULT_WORKLOAD = "qwen3-omni-0.30"

PRESETS: dict[str, dict[str, Any]] = {
    # What vllm-omni 0.30.0 sends thinker -> talker with async_chunk (its Qwen3-Omni deploy), from
    # stage_input_processors/qwen3_omni.py (thinker2talker_async_chunk) and the chunk transfer adapter: chunk 0 is
    # sent once the thinker sampled its first token ([P+1, 2048]: the prompt rows and that token's row; ids.all has
    # P+1 ids, ids.prompt P); every later chunk one embed.decode row; the adapter sets meta.finished and
    # meta.is_segment_finished on every chunk. speaker / language ride on every chunk only when the request names
    # them (None is left off the wire), so they are not modelled. The end-to-end runs (benchmarks/e2e) counted
    # these keys live. The talker -> code2wav pair is the ``talker-code2wav`` preset.
    "qwen3-omni-0.30": {
        "description": "vllm-omni 0.30.0 thinker -> talker (async_chunk): chunk 0 the prefill hand-off ([P+1,2048] "
        "bf16 embed.prefill and hidden_states.output, embed.tts_bos/eos/pad [1,1,2048], ids.all, ids.prompt), then "
        "one embed.decode [1,2048] row per step, which the talker takes and the receiver drops (read delta); "
        "meta.finished and meta.is_segment_finished on every chunk",
        "context_len": 8000,
        "decode_steps": 100,
        "concurrency": [1, 10],
        "policy": "qwen3-omni",
        "keys": [
            {"path": "embed.prefill", "kind": "append", "carried": "first", "extra_first_rows": 1, "read": "delta"},
            {
                "path": "hidden_states.output",
                "kind": "append",
                "carried": "first",
                "extra_first_rows": 1,
                "read": "delta",
            },
            {"path": "embed.tts_bos", "kind": "static", "carried": "first", "rows": 1, "row_shape": _STATIC_TTS},
            {"path": "embed.tts_eos", "kind": "static", "carried": "first", "rows": 1, "row_shape": _STATIC_TTS},
            {"path": "embed.tts_pad", "kind": "static", "carried": "first", "rows": 1, "row_shape": _STATIC_TTS},
            {
                "path": "ids.all",
                "kind": "static",
                "value": "ids",
                "carried": "first",
                "extra_first_rows": 1,
                "read": "never",
            },
            {"path": "ids.prompt", "kind": "static", "value": "ids", "carried": "first", "read": "never"},
            {"path": "embed.decode", "kind": "append", "carried": "decode", "rows": 1, "read": "delta"},
            {"path": "meta.finished", "kind": "replace", "value": "flag", "carried": "every"},
            {"path": "meta.is_segment_finished", "kind": "replace", "value": "flag", "carried": "every"},
        ],
    },
    "qwen3-omni-seed": {
        "description": "the 0.16-era stream (pre-#1656 flat keys, the seed benchmark): [P+1,2048] prefill, 100 "
        "decode rows appended to thinker_embeddings, consumer reads the newest row of the whole tensor every chunk",
        "context_len": 8000,
        "decode_steps": 100,
        "concurrency": [1, 10],
        "policy": "qwen3-omni-flat",
        "keys": [
            {
                "path": "thinker_embeddings",
                "kind": "append",
                "carried": "every",
                "extra_first_rows": 1,
                "read": "newest_row",
            },
            {
                "path": "thinker_hidden_states",
                "kind": "append",
                "carried": "first",
                "extra_first_rows": 1,
                "read": "never",
            },
            {"path": "tts_bos_embed", "kind": "static", "carried": "first", "rows": 1, "row_shape": _STATIC_TTS},
            {"path": "tts_eos_embed", "kind": "static", "carried": "first", "rows": 1, "row_shape": _STATIC_TTS},
            {"path": "tts_pad_embed", "kind": "static", "carried": "first", "rows": 1, "row_shape": _STATIC_TTS},
            {
                "path": "thinker_sequences",
                "kind": "static",
                "value": "ids",
                "carried": "first",
                "extra_first_rows": 1,
                "read": "never",
            },
            {"path": "thinker_input_ids", "kind": "static", "value": "ids", "carried": "first", "read": "never"},
            {"path": "finished", "kind": "replace", "value": "bool", "carried": "every"},
        ],
    },
    "qwen3-omni-chunked-prefill": {
        "description": "chunked prefill: P=32000 prefill rows in chunks of 2048, read once when prefill completes",
        "context_len": 32000,
        "prefill_chunk": 2048,
        "policy": "qwen3-omni",
        "decode_steps": 0,
        "concurrency": [1],
        "keys": [
            {"path": "embed.prefill", "kind": "append", "carried": "prefill", "read": "end"},
            {"path": "hidden_states.output", "kind": "append", "carried": "prefill", "read": "end"},
            {"path": "meta.finished", "kind": "replace", "value": "flag", "carried": "every"},
        ],
    },
    "qwen3-omni-full-payload": {
        "description": "non-async full-payload accumulator: P prefill rows then one row and one id per step, "
        "appended every step, read once at flush",
        "context_len": 8000,
        "decode_steps": 100,
        "concurrency": [1],
        "policy": "qwen3-omni",
        "keys": [
            {"path": "hidden_states.output", "kind": "append", "carried": "every", "read": "end"},
            {"path": "ids.output", "kind": "append", "value": "ids", "carried": "decode", "read": "end"},
            {"path": "meta.finished", "kind": "replace", "value": "flag", "carried": "every"},
        ],
    },
    "qwen3-omni-override-ids": {
        "description": "2026-03..05 decode chunks: embed.decode replaced, cumulative ids.output and the constant "
        "meta.override_keys list re-sent every step",
        "context_len": 8000,
        "decode_steps": 100,
        "concurrency": [1],
        "policy": "qwen3-omni",
        "keys": [
            {"path": "embed.prefill", "kind": "append", "carried": "first", "extra_first_rows": 1, "read": "never"},
            {
                "path": "hidden_states.output",
                "kind": "append",
                "carried": "first",
                "extra_first_rows": 1,
                "read": "never",
            },
            {"path": "embed.tts_bos", "kind": "static", "carried": "first", "rows": 1, "row_shape": _STATIC_TTS},
            {"path": "embed.tts_eos", "kind": "static", "carried": "first", "rows": 1, "row_shape": _STATIC_TTS},
            {"path": "embed.tts_pad", "kind": "static", "carried": "first", "rows": 1, "row_shape": _STATIC_TTS},
            {"path": "ids.prompt", "kind": "static", "value": "ids", "carried": "first", "read": "never"},
            {"path": "embed.decode", "kind": "replace", "carried": "decode", "rows": 1, "read": "every"},
            {
                "path": "ids.output",
                "kind": "replace",
                "value": "ids",
                "carried": "decode",
                "cumulative": True,
                "read": "every",
            },
            {
                "path": "meta.override_keys",
                "kind": "static",
                "value": "names",
                "carried": "decode",
                "names": [["embed", "decode"], ["ids", "output"]],
                "read": "never",
            },
            {"path": "meta.finished", "kind": "replace", "value": "flag", "carried": "every"},
        ],
    },
    "talker-code2wav": {
        "description": "talker -> code2wav: codes.audio windows of 16 codebooks x W frames (W = 4, 29, then 50), "
        "replaced each chunk",
        "context_len": 1,
        "decode_steps": 40,
        "concurrency": [1, 10],
        "policy": "qwen3-omni",
        "keys": [
            {
                "path": "codes.audio",
                "kind": "replace",
                "value": "codes",
                "dtype": "int64",
                "carried": "every",
                "windows": [4, 29, 50],
                "read": "every",
            },
            {
                "path": "meta.left_context_size",
                "kind": "replace",
                "value": "ids",
                "carried": "every",
                "rows": 1,
                "read": "every",
            },
            {"path": "meta.finished", "kind": "replace", "value": "flag", "carried": "every"},
        ],
    },
}
