"""The payload keys each release family's stages send, as flat key paths (what a policy's rules match).

Read from vllm-omni's own code: the Qwen3-Omni stage input processors
(``model_executor/stage_input_processors/qwen3_omni.py``: ``thinker2talker_async_chunk`` and its streaming
and full-payload variants, ``talker2code2wav_async_chunk``), whose nested payloads
(``OmniPayloadStruct``) travel as ``embed.prefill``, ``meta.finished`` ...; the chunk transfer adapter
adds ``meta.is_segment_finished``, the runner's transport reads ``meta.override_keys``. 0.28.0 sends the
same keys (its processor's body is 0.30.0's). ``omni-accum doctor`` warns about a policy whose rules and
tuned cells match none of them: it would change nothing on this release.
"""

from __future__ import annotations

#: Thinker -> talker and talker -> code2wav keys of Qwen3-Omni in vllm-omni 0.28.0 and 0.30.0.
QWEN3_OMNI_KEYS: frozenset[str] = frozenset(
    {
        "embed.prefill",
        "embed.decode",
        "hidden_states.output",
        "embed.tts_bos",
        "embed.tts_eos",
        "embed.tts_pad",
        "ids.all",
        "ids.prompt",
        "ids.output",
        "meta.finished",
        "meta.is_segment_finished",
        "meta.override_keys",
        "speaker",
        "language",
        "codes.audio",
        "meta.left_context_size",
    }
)

#: The same in vllm-omni 0.16.0: flat keys (its ``qwen3_omni.py`` processors; the adapter adds nothing).
QWEN3_OMNI_KEYS_016: frozenset[str] = frozenset(
    {
        "thinker_embeddings",
        "thinker_hidden_states",
        "thinker_input_ids",
        "thinker_sequences",
        "tts_bos_embed",
        "tts_eos_embed",
        "tts_pad_embed",
        "finished",
        "code_predictor_codes",
    }
)

#: Release family name (``"0.30"``) -> the keys its stages send.
SENT_KEYS: dict[str, frozenset[str]] = {
    "0.16": QWEN3_OMNI_KEYS_016,
    "0.28": QWEN3_OMNI_KEYS,
    "0.30": QWEN3_OMNI_KEYS,
}
