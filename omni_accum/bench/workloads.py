"""Workloads: the shape of a deployment's chunk traffic, as validated data.

A workload names its keys (path, kind, value type, per-chunk shape and dtype, which chunks carry
it, how the consumer reads it) and a chunk schedule (prefill rows P = the context length, arriving
in one chunk or in chunks of ``prefill_chunk`` rows, then ``decode_steps`` decode chunks). The six
presets model Qwen3-Omni's traffic (:mod:`omni_accum.bench.workload_presets` says where the shapes
come from); users write their own in the same schema
as a YAML file (``omni-accum bench --workload my.yaml``).

:func:`~omni_accum.bench.streams.build_stream` turns a workload into the chunk dicts of one
request; the presets are in :mod:`omni_accum.bench.workload_presets`.

Example (YAML)::

    name: my-model
    context_len: 4000
    decode_steps: 50
    concurrency: [1, 8]
    keys:
      - {path: embed.prefill, kind: append, carried: prefill, row_shape: [2048], read: end}
      - {path: embed.decode, kind: append, carried: decode, row_shape: [2048], read: delta}
      - {path: meta.finished, kind: replace, value: flag, carried: every}
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from omni_accum.bench.workload_presets import PRESETS
from omni_accum.errors import OmniAccumError
from omni_accum.policy.loader import got_suffix
from omni_accum.policy.parsing import DuplicateKeyError, LineIndex, load_json, load_yaml
from omni_accum.policy.sources import probe

ReadPattern = Literal["every", "newest_row", "delta", "end", "never"]
Carried = Literal["first", "prefill", "decode", "every"]
ValueType = Literal["tensor", "ids", "flag", "bool", "names", "codes"]


#: The most rows a workload may ask for: a context length (prefill rows), rows or frames of one chunk,
#: codebooks, decode steps. A bf16 [1_000_000, 2048] prefill is 4 GB, per key.
MAX_ROWS = 1_000_000
#: The most elements in one row (the product of ``row_shape``).
MAX_ROW_ELEMENTS = 1 << 24

#: A row count: 1 to :data:`MAX_ROWS`.
Rows = Annotated[int, Field(ge=1, le=MAX_ROWS)]


class WorkloadError(OmniAccumError):
    """A workload file or preset is unknown or invalid; the message names the field."""


class KeySpec(BaseModel):
    """One key of the payload and how it travels."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1)
    """Key path: ``group.qualifier`` (nested payload) or a flat name (``thinker_embeddings``)."""
    kind: Literal["append", "replace", "static"]
    """``append``: the view is the concatenation of every value; ``replace``: the latest value wins;
    ``static``: replace-kind, same value in every chunk that carries it."""
    value: ValueType = "tensor"
    """``tensor`` (rows x row_shape), ``ids`` (int list), ``flag`` (0-d bool tensor), ``bool`` (a Python
    bool, the flat ``finished`` of pre-#1656 releases), ``names`` (the
    constant ``override_keys`` list of ``[group, qualifier]`` pairs), ``codes`` (1-D int64 of
    ``codebooks`` x window frames)."""
    row_shape: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [2048])
    """Trailing shape of a tensor value (a chunk is ``[rows, *row_shape]``); positive sizes."""
    dtype: Literal["bfloat16", "float16", "float32", "int64", "int32"] = "bfloat16"
    """Tensor dtype."""
    carried: Carried = "every"
    """Which chunks carry the key: ``first`` (chunk 0 only, all prefill rows), ``prefill`` (every
    prefill chunk, its rows), ``decode`` (every decode chunk), ``every`` (every chunk)."""
    rows: Rows | None = None
    """Rows per chunk; default: the chunk's prefill rows (``first``/``prefill``), else 1."""
    extra_first_rows: int = Field(default=0, ge=0, le=MAX_ROWS)
    """Rows added to the first chunk (the seed's ``P+1``: prefill plus the first sampled token)."""
    cumulative: bool = False
    """``ids`` only: send the whole id list so far (2026-03..05 ``ids.output``) instead of the new ids."""
    windows: list[Rows] = Field(default_factory=list)
    """``codes`` only: frames per chunk; the last entry repeats (talker -> code2wav: 4, 29, 50)."""
    codebooks: int = Field(default=16, ge=1, le=MAX_ROWS)
    """``codes`` only: codebooks per frame."""
    names: list[list[str]] = Field(default_factory=list)
    """``names`` only: the key pairs listed (``[[embed, decode], [ids, output]]``)."""
    read: ReadPattern = "every"
    """How the consumer reads the key: ``every`` (the whole view after every chunk), ``newest_row`` (the
    newest row of the whole accumulated tensor after every chunk), ``delta`` (append keys: after every
    chunk that carries the key the consumer takes what accumulated since its last take and the receiver
    drops it, as vllm-omni 0.30.0's receiving stage hands each chunk's rows to the model once and keeps
    none, e.g. ``embed.decode``), ``end`` (once after the last chunk) or ``never``."""

    @model_validator(mode="after")
    def _check(self) -> KeySpec:
        if math.prod(self.row_shape) > MAX_ROW_ELEMENTS:
            raise ValueError(
                f"key {self.path!r}: row_shape {self.row_shape} has {math.prod(self.row_shape)} elements per row; "
                f"at most {MAX_ROW_ELEMENTS}"
            )
        if self.kind == "append" and self.value in ("flag", "bool", "names"):
            raise ValueError(f"key {self.path!r}: a {self.value!r} value cannot be append-kind; use replace or static")
        if self.value == "codes" and not self.windows:
            raise ValueError(f"key {self.path!r}: value 'codes' needs windows (frames per chunk)")
        if self.read == "newest_row" and self.value not in ("tensor", "ids", "codes"):
            raise ValueError(f"key {self.path!r}: read 'newest_row' needs a tensor or list value")
        if self.read == "delta" and self.kind != "append":
            raise ValueError(
                f"key {self.path!r}: read 'delta' (the consumer takes and drops the rows accumulated since its "
                f"last take) needs an append key, got kind {self.kind!r}; use read 'every' for a {self.kind} key"
            )
        return self


class Workload(BaseModel):
    """A workload: keys and a chunk schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    """Name shown in tables and JSON."""
    description: str = ""
    """What traffic this models."""
    context_len: int = Field(default=8000, ge=1, le=MAX_ROWS)
    """Default prefill rows P (the context length); ``--context-lens`` overrides it per bucket."""
    prefill_chunk: Rows | None = None
    """Rows per prefill chunk (chunked prefill); None: the whole prefill in chunk 0."""
    decode_steps: int = Field(default=100, ge=0, le=MAX_ROWS)
    """Decode chunks after the prefill."""
    concurrency: list[int] = Field(default_factory=lambda: [1])
    """Default concurrency levels benchmarked."""
    context_lens: list[int] = Field(default_factory=list)
    """Default context lengths benchmarked (empty: ``[context_len]``)."""
    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    """Seed of the generated data (0 to 2**32 - 1)."""
    policy: str | None = None
    """Policy preset (or file) made for this traffic; benchmarked as an arm by default."""
    keys: list[KeySpec] = Field(min_length=1)
    """The payload's keys."""

    @field_validator("concurrency", "context_lens")
    @classmethod
    def _positive(cls, v: list[int], info: ValidationInfo) -> list[int]:
        if any(x < 1 for x in v):
            raise ValueError(f"values must be >= 1, got {v}")
        if info.field_name == "context_lens" and any(x > MAX_ROWS for x in v):
            raise ValueError(f"values must be <= {MAX_ROWS}, got {v}")
        return v

    @model_validator(mode="after")
    def _unique(self) -> Workload:
        seen: dict[str, int] = {}
        for i, k in enumerate(self.keys):
            if k.path in seen:
                raise ValueError(f"keys[{i}].path {k.path!r} is listed twice (also keys[{seen[k.path]}].path)")
            seen[k.path] = i
        nested = {k.path.split(".", 1)[0] for k in self.keys if "." in k.path}
        flat = {k.path for k in self.keys if "." not in k.path}
        clash = nested & flat
        if clash:
            raise ValueError(f"key(s) {sorted(clash)} are both a flat key and a group")
        return self

    # -- schedule ----------------------------------------------------------------------------- #
    def prefill_chunks(self, context_len: int | None = None) -> list[int]:
        """Rows of each prefill chunk for ``context_len`` (default :attr:`context_len`)."""
        p = context_len or self.context_len
        c = self.prefill_chunk or p
        return [min(c, p - s) for s in range(0, p, c)]

    def n_chunks(self, context_len: int | None = None) -> int:
        """Chunks per request."""
        return len(self.prefill_chunks(context_len)) + self.decode_steps

    def keys_of_kind(self, *kinds: str) -> list[str]:
        """Paths of the keys whose kind is one of ``kinds``."""
        return [k.path for k in self.keys if k.kind in kinds]

    def key(self, path: str) -> KeySpec:
        for k in self.keys:
            if k.path == path:
                return k
        raise KeyError(path)

    def default_context_lens(self) -> list[int]:
        return list(self.context_lens or [self.context_len])


def workload_names() -> list[str]:
    """Names of the built-in workload presets."""
    return sorted(PRESETS)


def _format_errors(err: ValidationError, source: str, text: str | None = None) -> str:
    lines = []
    for e in err.errors():
        loc = ""
        for p in e["loc"]:
            loc += f"[{p}]" if isinstance(p, int) else (f".{p}" if loc else str(p))
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        msg += "" if e["type"] == "extra_forbidden" else got_suffix({**e, "msg": msg})  # the value given
        item = None if e["loc"] else re.match(r"keys\[(\d+)\]\.path ", msg)  # a whole-workload check naming a key
        at = ("keys", int(item[1]), "path") if item else tuple(e["loc"])
        line = LineIndex(text)(at) if text is not None else None
        where = f"line {line}: " if line else ""
        lines.append(f"{source}: {where}{msg}" if item else f"{source}: {where}{loc or '(top level)'}: {msg}")
    return "invalid workload:\n  " + "\n  ".join(lines)


def build_workload(data: Any, source: str = "<mapping>", text: str | None = None) -> Workload:
    """Validate a mapping into a :class:`Workload`; :class:`WorkloadError` names every bad field, the value given
    (and, given the file's ``text``, its line). A file's values are taken as written (``text`` given: pydantic's
    strict mode, as a policy file's): ``context_len: "64"`` is refused, not read as 64."""
    if not isinstance(data, Mapping):
        raise WorkloadError(f"{source}: a workload must be a mapping with 'name' and 'keys', got {type(data).__name__}")
    try:
        return Workload.model_validate(dict(data), strict=text is not None)
    except ValidationError as e:
        raise WorkloadError(_format_errors(e, source, text)) from e


def _looks_like_path(name: str) -> bool:
    """A name meant as a file: it has a workload file extension or a path separator."""
    seps = [os.sep] + ([os.altsep] if os.altsep else [])
    return Path(name).suffix.lower() in (".yaml", ".yml", ".json") or any(s in name for s in seps)


def _holds_capture(folder: Path) -> bool:
    """``folder`` holds capture files (``capture-*.jsonl``, as :func:`omni_accum.capture.reader.capture_files` finds
    them; named here: the capture package imports this module)."""
    try:
        return any(x.name.startswith("capture-") and x.name.endswith(".jsonl") for x in folder.iterdir())
    except OSError:
        return False


def load_workload(source: str | os.PathLike[str] | Mapping[str, Any] | Workload) -> Workload:
    """Load a workload: a preset name, a YAML/JSON file path, a mapping, or a Workload (returned as is)."""
    if isinstance(source, Workload):
        return source
    if isinstance(source, Mapping):
        return build_workload(source)
    name = str(source)
    if name in PRESETS:
        return build_workload({"name": name, **PRESETS[name]}, f"preset {name!r}")
    path = Path(name)
    presets = f"Available presets: {', '.join(workload_names())}"
    if probe(path, "is_dir"):
        if _holds_capture(path):
            raise WorkloadError(f"{name} is a capture folder: give it with --trace {name}")
        raise WorkloadError(f"{name}: is a folder, not a workload file. {presets}")
    if not probe(path, "is_file"):
        if _looks_like_path(name):
            raise WorkloadError(f"no such workload file: {name}. {presets}")
        raise WorkloadError(f"{name!r} is neither a workload file nor a preset. {presets}")
    fmt = "JSON" if path.suffix.lower() == ".json" else "YAML"
    try:
        text = path.read_text(encoding="utf-8")
        data = load_json(text) if fmt == "JSON" else load_yaml(text)
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{path}: cannot read workload file: {e}") from e
    except DuplicateKeyError as e:
        line = f"line {e.second_line}: " if e.second_line else ""
        raise WorkloadError(f"{path}: {line}invalid {fmt}: {e.problem}") from e
    except yaml.YAMLError as e:
        from omni_accum.policy.parsing import yaml_error_parts

        line, problem = yaml_error_parts(e)
        raise WorkloadError(f"{path}: {line}invalid YAML: {problem}") from e
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{path}: line {e.lineno}, column {e.colno}: invalid JSON: {e.msg}") from e
    except RecursionError as e:
        raise WorkloadError(f"{path}: invalid {fmt}: nested too deeply") from e
    except (ValueError, TypeError, IndexError, OverflowError) as e:  # PyYAML's bad tagged scalars (``!!int x``)
        raise WorkloadError(f"{path}: invalid {fmt} value: {type(e).__name__}: {e}") from e
    if data is None:
        raise WorkloadError(f"{path}: the workload file is empty; it needs at least 'keys' (and usually 'name')")
    if isinstance(data, Mapping) and "name" not in data:
        data = {"name": path.stem, **data}
    return build_workload(data, str(path), text)


def dump_workload(workload: Workload) -> str:
    """YAML text of a workload (loadable with :func:`load_workload`)."""
    return yaml.safe_dump(workload.model_dump(mode="json"), sort_keys=False, default_flow_style=None, width=120)
