"""Build a tiny random-weight Qwen3-Omni (thinker -> talker -> code2wav) for the e2e harness.

    benchmarks/e2e/.work/venv/bin/python benchmarks/e2e/build_model.py [--variant tiny|light|lean] [--out DIR] [--force]
    benchmarks/e2e/.work/venv-016/bin/python benchmarks/e2e/build_model.py [--variant NAME]   # vllm-omni 0.16.0

No model hub is needed: the config comes from ``transformers.Qwen3OmniMoeConfig``, the weights are
random (seeded, so every build is the same), the tokenizer is a byte-level BPE built here.

What is real and what is not:

* thinker hidden size is Qwen3-Omni-30B-A3B's 2048, so the stage payloads have the real width
  (``[P+1, 2048]`` prefill embeddings, ``[1, 2048]`` per decode step) and the real vocabulary size
  (152064); everything else is tiny: 2 layers, 4 experts (top-2), head_dim 64 (the CPU attention
  backend refuses 16), small intermediate sizes; 1-layer audio / vision encoders, 1-layer talker
  and code predictor (hidden 128), 1-layer code2wav (hidden 64, the real upsampling rates, so one
  codec frame is 1920 samples at 24 kHz as in the real model).
* the tokenizer keeps every id vllm-omni hard-codes: the Qwen special tokens 151643-151675 at their
  real ids and the role words ``system`` (8948), ``user`` (872), ``assistant`` (77091); any other
  text is encoded byte by byte (a few common merges), so the ids differ from Qwen's but are stable.
* with random weights the talker rarely emits codec EOS: the deploy config caps its max_tokens.

Variants (``--variant``; each has its own folder):

* ``tiny`` (default, ``.work/model``): the model above.
* ``light`` (``.work/model-light``): the same payload widths (thinker hidden 2048, vocabulary 152064,
  talker hidden 128) with little compute (lean has less, in attention only), so that the hand-off between
  stages takes the share of a request's latency it takes on a GPU server: one thinker layer with 2
  attention heads (1 KV head, head_dim 64), a MoE of 2 experts (top-1, intermediate 32), intermediate
  sizes of 64; talker and code predictor likewise (1 layer, 2 heads, 2 experts); code2wav with
  hidden 32 and decoder width 32. With one layer, the talker's ``accept_hidden_layer`` is 0 (the only
  layer vllm-omni can capture: it captures a layer's input), so ``hidden_states.output`` is the
  thinker's embedding output: still a ``[P, 2048]`` bf16 tensor of its own on the wire.
* ``lean`` (``.work/model-lean``): the light model with one attention head of head_dim 32 (the CPU
  attention backend's smallest) in the thinker, the talker and the code predictor instead of two of 64:
  a quarter of the attention work, the part of a prefill that grows with the square of the input and
  most of light's prefill time at 32k on a CPU. Its hidden sizes, vocabularies and payloads are light's.

vllm-omni 0.16.0 (this script run by ``.work/venv-016``'s python, into ``.work/model-016`` /
``.work/model-light-016``): the config in transformers 4.x's layout (``rope_theta`` / ``rope_scaling``),
and 25 thinker layers with the talker's ``accept_hidden_layer`` 24, in both variants: 0.16.0's stage
input processors read the captured hidden states under the literal key ``"24"``.

The output folder is rebuilt only when missing, when ``--force`` is given, or when this script
changed (a hash of it is stored in ``omni_accum_e2e_build.json``). An existing ``--out`` folder (or its
``DIR.tmp`` build folder) that this script did not make (no ``omni_accum_e2e_build.json`` of its own in it,
and not empty) is refused before anything is built, unless ``--force``: the build replaces the folder; a file
there is always refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("tiny", "light", "lean")
OUT_DIRS = {"tiny": HERE / ".work" / "model", "light": HERE / ".work" / "model-light",
            "lean": HERE / ".work" / "model-lean"}
# vllm-omni 0.16.0's environment (setup_env.sh --release 0.16) has transformers 4.57, whose Qwen3-Omni config
# takes rope_theta / rope_scaling (not 5.x's rope_parameters) and whose MoE weights are per expert: its
# models are built by that environment's python into their own folders (run.py --release 0.16 uses them).
OUT_DIRS_016 = {"tiny": HERE / ".work" / "model-016", "light": HERE / ".work" / "model-light-016",
                "lean": HERE / ".work" / "model-lean-016"}


def installed_release() -> str:
    """``0.16`` when the running environment has vllm-omni 0.16.x, else ``0.30``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "0.16" if version("vllm-omni").startswith("0.16.") else "0.30"
    except PackageNotFoundError:
        return "0.30"


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def rope(params: dict) -> dict:
    """``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x) for one text config."""
    if transformers_major() >= 5:
        return {"rope_parameters": dict(params)}
    rest = {k: v for k, v in params.items() if k != "rope_theta"}
    scaling = rest if set(rest) - {"rope_type"} else None  # only the plain default: no scaling dict
    return {"rope_theta": params["rope_theta"], "rope_scaling": scaling}
SEED = 1234
STAMP = "omni_accum_e2e_build.json"
BUILDER = "benchmarks/e2e/build_model.py"  # the stamp's "builder": a folder this script made
# written first into DIR.tmp (the stamp is written last): a half-built folder of this script's, safe to replace
BUILDING = ".omni_accum_e2e_building"

THINKER_HIDDEN = 2048
VOCAB_SIZE = 152064

# Qwen2/Qwen3 special tokens at their real ids (vllm-omni's Qwen3-Omni code hard-codes several).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
]  # fmt: skip
FIRST_SPECIAL_ID = 151643
ROLE_WORDS = {"system": 8948, "user": 872, "assistant": 77091}
# A few merges so that ordinary English text is not purely one token per byte.
COMMON_WORDS = ["Ġthe", "Ġand", "Ġyou", "Ġhello", "Hello", "Ġworld", "Ġis", "Ġa", "Ġto", "Ġof", "Ġin", "Ġsay"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] == 'audio' or part['type'] == 'input_audio' or 'audio' in part %}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' or part['type'] == 'video_url' or 'video' in part %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def log(msg: str) -> None:
    print(f"[build_model] {msg}", file=sys.stderr, flush=True)


def script_hash(variant: str = "tiny", release: str = "0.30") -> str:
    tag = variant if release == "0.30" else f"{variant}@{release}"
    return hashlib.sha256(Path(__file__).read_bytes() + tag.encode()).hexdigest()[:16]


def build_tokenizer_json() -> str:
    """A byte-level BPE whose role words and special tokens sit at Qwen's ids, padded to VOCAB_SIZE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 byte-level symbols
    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []
    for i, ch in enumerate(sorted(alphabet)):
        vocab[ch] = i
    reserved = set(ROLE_WORDS.values())
    next_id = len(vocab)

    def new_id() -> int:
        nonlocal next_id
        while next_id in reserved:
            next_id += 1
        next_id += 1
        return next_id - 1

    def add_word(word: str, fixed: int | None = None) -> None:
        # Left-to-right merges: w, wo, wor, word; each prefix a token.
        cur = word[0]
        for ch in word[1:]:
            nxt = cur + ch
            if (cur, ch) not in merges:
                merges.append((cur, ch))
            if nxt not in vocab:
                vocab[nxt] = fixed if (fixed is not None and nxt == word) else new_id()
            cur = nxt

    for word, wid in ROLE_WORDS.items():
        add_word(word, wid)
    for word in COMMON_WORDS:
        add_word(word)
    used = set(vocab.values())
    filler = 0
    for i in range(FIRST_SPECIAL_ID):
        if i not in used:
            vocab[f"<|e2e_filler_{filler}|>"] = i
            filler += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    n = tok.get_vocab_size()
    assert n == FIRST_SPECIAL_ID + len(SPECIAL_TOKENS), n
    return tok.to_str()


def build_tokenizer(out: Path):
    from transformers import Qwen2TokenizerFast

    tj = out / "_tokenizer_src.json"
    tj.write_text(build_tokenizer_json())
    extra = {
        "image_token": "<|image_pad|>",
        "audio_token": "<|audio_pad|>",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
    }
    tok = Qwen2TokenizerFast(
        tokenizer_file=str(tj),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        extra_special_tokens=extra,
        model_max_length=65536,  # the long-input arms (32k prompts)
    )
    tok.chat_template = CHAT_TEMPLATE
    tj.unlink()
    return tok


def check_tokenizer(tok) -> None:
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(t) == FIRST_SPECIAL_ID + i, t
    ids = tok.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "Say hello"}],
        tokenize=True,
        add_generation_prompt=True,
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    im_start = FIRST_SPECIAL_ID + 1
    roles = [ids[i + 1] for i, t in enumerate(ids) if t == im_start]
    assert roles == [ROLE_WORDS["system"], ROLE_WORDS["user"], ROLE_WORDS["assistant"]], (roles, ids)


# The light variant: the tiny model's dicts with these entries replaced (payload widths unchanged).
LIGHT = {
    "thinker.text_config": {
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
        "moe_intermediate_size": 32, "num_experts": 2, "num_experts_per_tok": 1,
    },
    "talker.text_config": {
        "intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "num_experts": 2, "num_experts_per_tok": 1,
    },
    "talker.code_predictor_config": {"intermediate_size": 64},
    # vllm-omni captures a thinker layer's input: with one layer, layer 0 is the only one it can capture.
    "talker": {"accept_hidden_layer": 0},
    "code2wav": {"hidden_size": 32, "intermediate_size": 64, "decoder_dim": 32},
}  # fmt: skip

# The lean variant: the light one's entries, then these (payload widths unchanged): one attention head of
# head_dim 32 (the CPU attention backend's smallest) in the thinker, the talker and the code predictor, a quarter
# of light's attention work, which is what grows with the input (quadratically: most of a 32k prefill's time).
# M-RoPE splits head_dim / 2 = 16 rotary pairs over time, height and width as the real model splits its 64.
LEAN_ATTENTION = {"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 32}
LEAN = {
    "thinker.text_config": {**LEAN_ATTENTION, "mrope_section": [6, 5, 5]},
    "talker.text_config": {**LEAN_ATTENTION, "mrope_section": [6, 5, 5]},
    "talker.code_predictor_config": dict(LEAN_ATTENTION),
}


# vllm-omni 0.16.0's Qwen3-Omni stage input processors read the thinker's captured hidden states under the
# literal key "24" (``pooling_output.get("24")``: the real model's accept_hidden_layer); the thinker captures
# layers 0 and ``accept_hidden_layer`` by index. So its models have 25 thinker layers and capture layer 24
# (each layer as small as the variant's; the light one stays far below its LM head's compute). And 0.16.0's
# M-RoPE positions read the thinker config's ``seconds_per_chunk`` for every request (the talker's first
# step failed without it; transformers 4.57's Qwen3-Omni config has no such field): the real model's 2.
RELEASE_016 = {
    "thinker": {"seconds_per_chunk": 2},
    "thinker.text_config": {"num_hidden_layers": 25},
    "talker": {"accept_hidden_layer": 24},
}


def apply_variant(variant: str, parts: dict[str, dict], release: str = "0.30") -> None:
    """Replace the entries LIGHT names (``part.sub_config``) in the tiny model's config dicts, then for ``lean``
    LEAN's (its ``mrope_section`` goes inside the rope dict); then, for vllm-omni 0.16.0, RELEASE_016's."""
    tables = {"tiny": [], "light": [LIGHT], "lean": [LIGHT, LEAN]}[variant]
    for table in tables + ([RELEASE_016] if release == "0.16" else []):
        for where, changes in table.items():
            part, _, sub = where.partition(".")
            target = parts[part][sub] if sub else parts[part]
            changes = dict(changes)
            section = changes.pop("mrope_section", None)
            target.update(changes)
            if section is not None:  # inside the rope dict of the layout this transformers reads
                rope_key = "rope_parameters" if "rope_parameters" in target else "rope_scaling"
                target[rope_key] = {**target[rope_key], "mrope_section": section}


def build_config(variant: str = "tiny", release: str = "0.30"):
    from transformers import Qwen3OmniMoeConfig

    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [12, 10, 10],
             "interleaved": True, "mrope_interleaved": True}  # fmt: skip
    thinker = {
        "audio_config": {
            "num_mel_bins": 128, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 128,
            "d_model": 64, "output_dim": THINKER_HIDDEN, "downsample_hidden_size": 32, "n_window": 50,
            "n_window_infer": 800, "conv_chunksize": 500, "max_source_positions": 1500,
        },
        "vision_config": {
            "depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": THINKER_HIDDEN,
            "num_position_embeddings": 2304, "deepstack_visual_indexes": [0], "image_size": 768,
            "apply_vit_abs_pos_embed": True,
        },
        "text_config": {
            "vocab_size": VOCAB_SIZE, "hidden_size": THINKER_HIDDEN, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
            "norm_topk_prob": True, "max_position_embeddings": 65536, **rope(mrope),
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        },
        "position_id_per_seconds": 13, "audio_start_token_id": 151669, "audio_token_id": 151675,
        "image_token_id": 151655, "video_token_id": 151656, "user_token_id": 872,
        "audio_end_token_id": 151670, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    }  # fmt: skip
    talker = {
        "text_config": {
            "vocab_size": 3072, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
            "decoder_sparse_step": 1, "norm_topk_prob": False, "max_position_embeddings": 65536,
            **rope(mrope), "rms_norm_eps": 1e-6,
        },
        "code_predictor_config": {
            "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "num_code_groups": 16,
            "max_position_embeddings": 65536, **rope({"rope_type": "default", "rope_theta": 1000000.0}),
        },
        "num_code_groups": 16, "thinker_hidden_size": THINKER_HIDDEN, "accept_hidden_layer": 1,
        "codec_eos_token_id": 2150, "codec_nothink_id": 2155, "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157, "codec_pad_id": 2148, "codec_bos_id": 2149,
        "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
        "vision_start_token_id": 151652, "position_id_per_seconds": 13, "audio_start_token_id": 151669,
        "audio_end_token_id": 151670, "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        "spatial_merge_size": 2,
    }  # fmt: skip
    code2wav = {
        "codebook_size": 2048, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_quantizers": 16, "sliding_window": 72,
        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 64,
        "max_position_embeddings": 8000,
    }  # fmt: skip
    apply_variant(variant, {"thinker": thinker, "talker": talker, "code2wav": code2wav}, release)
    cfg = Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
    )
    cfg.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    return cfg


def build_processor(out: Path, tok) -> None:
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    try:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)
    except Exception:  # noqa: BLE001 - older layouts
        video = None
    image = Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=300, n_fft=400)
    kwargs = {"image_processor": image, "feature_extractor": fe, "tokenizer": tok, "chat_template": CHAT_TEMPLATE}
    if video is not None:
        kwargs["video_processor"] = video
    proc = Qwen3OmniMoeProcessor(**kwargs)
    proc.save_pretrained(str(out))
    # The classic layout too (as the real checkpoint has): feature extractor + image processor settings.
    pre = {**fe.to_dict(), **image.to_dict(), "processor_class": "Qwen3OmniMoeProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2, sort_keys=True) + "\n")


def build(out: Path, variant: str = "tiny", release: str = "0.30") -> None:
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration, set_seed

    tmp = tmp_dir(out)
    if tmp.exists():  # main() checked it: a build folder of this script's, an empty one, or --force
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / BUILDING).write_text(f"{BUILDER}: a build in progress; its stamp {STAMP} is written last\n")
    log("tokenizer (byte-level BPE, Qwen special tokens and role words at their real ids)")
    tok = build_tokenizer(tmp)
    check_tokenizer(tok)
    tok.save_pretrained(str(tmp))
    log("processor (Whisper features, Qwen2-VL image / video processors, ChatML template)")
    build_processor(tmp, tok)
    log(f"config + random weights ({variant}, seed {SEED}, thinker hidden {THINKER_HIDDEN}, vocab {VOCAB_SIZE})")
    cfg = build_config(variant, release)
    set_seed(SEED)
    torch.manual_seed(SEED)
    prev = torch.get_default_dtype()
    model = Qwen3OmniMoeForConditionalGeneration(cfg)
    model = model.to(torch.bfloat16)
    torch.set_default_dtype(prev)
    model.generation_config.do_sample = False
    cfg.dtype = "bfloat16"
    if transformers_major() < 5:
        cfg.torch_dtype = torch.bfloat16  # 4.x writes this key
    model.save_pretrained(str(tmp), safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    del model
    (tmp / STAMP).write_text(
        json.dumps(
            {
                "builder": BUILDER,
                "variant": variant,
                "release": release,
                "hash": script_hash(variant, release),
                "seed": SEED,
                "params": n,
            },
            indent=1,
        )
    )
    (tmp / BUILDING).unlink()
    if out.exists():  # main() checked it: a model folder of this script's, an empty folder, or --force
        shutil.rmtree(out)
    tmp.rename(out)
    log(f"done: {out} ({n / 1e6:.1f} M parameters)")


def tmp_dir(out: Path) -> Path:
    """The folder a build is written into before it is renamed to ``out``."""
    return out.with_name(out.name + ".tmp")


def made_here(folder: Path) -> bool:
    """Whether ``folder`` is a model folder this script made (its stamp names this script as the builder) or
    one it was building (the marker it writes first)."""
    if (folder / BUILDING).is_file():
        return True
    try:
        return json.loads((folder / STAMP).read_text()).get("builder") == BUILDER
    except (OSError, ValueError, AttributeError):
        return False


def out_problem(out: Path, force: bool) -> str | None:
    """Why the build may not replace ``out`` (or its ``DIR.tmp``), or None: a file is refused; so is a folder
    that is neither empty nor one this script made, unless ``force``."""
    # the harness's own folders (and a build folder an older version of this script left there, with no marker)
    ours = out in (*OUT_DIRS.values(), *OUT_DIRS_016.values()) or made_here(out)
    for folder, what in ((out, ""), (tmp_dir(out), f"its build folder {tmp_dir(out)} ")):
        if not folder.exists() and not folder.is_symlink():
            continue
        if folder.is_symlink() or not folder.is_dir():
            return f"--out {out}: {what}exists and is not a folder (remove it, or give another --out)"
        if folder != out and ours:
            continue
        if not force and any(folder.iterdir()) and not made_here(folder):
            return (f"--out {out}: {what}exists and is not a model folder this script made (no {STAMP} "
                    "of its own in it): the build would delete it; give a new or empty folder, or --force to "
                    "replace it")  # fmt: skip
    return None


def is_current(out: Path, variant: str = "tiny", release: str = "0.30") -> bool:
    try:
        return json.loads((out / STAMP).read_text()).get("hash") == script_hash(variant, release)
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--variant",
        choices=VARIANTS,
        default="tiny",
        help="tiny: 2 thinker layers (default); light: the same payload widths with little compute; lean: light "
        "with one attention head of 32 in each stage's language model",
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="output folder (default .work/model, .work/model-light, .work/model-lean; in vllm-omni 0.16.0's "
        "environment .work/model-016, .work/model-light-016, .work/model-lean-016)",
    )
    ap.add_argument(
        "--force",
        action="store_true",
        help="rebuild even when the folder is current; also replace an existing --out folder that this script "
        "did not make (without it, such a folder is refused: the build deletes what is there)",
    )
    args = ap.parse_args(argv)
    release = installed_release()
    out = (args.out or (OUT_DIRS_016 if release == "0.16" else OUT_DIRS)[args.variant]).expanduser().resolve()
    problem = out_problem(out, args.force)
    if problem:
        ap.error(problem)
    if not args.force and is_current(out, args.variant, release):
        log(f"reusing {out} (up to date)")
        return 0
    build(out, args.variant, release)
    return 0


if __name__ == "__main__":
    sys.exit(main())
