"""The built-in workloads (``omni-accum bench --workload NAME``): Qwen3-Omni's chunk traffic.

Each preset is the mapping a workload file would hold (without ``name``); see
:mod:`omni_accum.bench.workloads` for the schema. The shapes are those of Qwen3-Omni's thinker -> talker ->
code2wav payloads in vllm-omni (hidden size 2048: a ``[P+1, 2048]`` prefill embedding, then one row per decode
step); each preset's ``description`` says which key layout (release) and traffic it models.
"""

from __future__ import annotations

from typing import Any

_H = [2048]
_STATIC_TTS = [1, 2048]  # a [1, 1, 2048] constant is one row of [1, 2048]

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-omni-seed": {
        "description": "seed benchmark (pre-#1656 flat keys): [P+1,2048] prefill, 100 decode rows appended to "
        "thinker_embeddings, consumer reads the newest row of the whole tensor every chunk",
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
