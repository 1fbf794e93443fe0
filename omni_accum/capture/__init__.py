"""Capture: record the chunk stream a deployment really sends, read it back, summarise and replay it.

* :mod:`~omni_accum.capture.writer`: :class:`CaptureWriter`, one bounded, crash-safe JSON-lines file per
  process (``OMNI_ACCUM_CAPTURE=DIR`` or the connector ``extra`` key ``omni_accum_capture``);
* :mod:`~omni_accum.capture.recorder`: one record per chunk and role, built from cached parts;
* :mod:`~omni_accum.capture.reader`: a capture folder back into records, a cut or corrupt line reported
  (file and line) and skipped;
* :mod:`~omni_accum.capture.trace`: the requests of a stage pair, their context lengths and concurrency,
  and a :class:`~omni_accum.capture.trace.CapturedWorkload` that ``bench --trace`` / ``tune --trace`` replay;
* :mod:`~omni_accum.capture.summary`: what ``omni-accum trace DIR`` prints.

Nothing here imports vllm or vllm-omni; the integration's hooks (``integrations/vllm_omni/capture.py``)
feed the recorder.
"""

from __future__ import annotations

from omni_accum.capture.recorder import ChunkRecorder, request_hash
from omni_accum.capture.writer import DEFAULT_KEEP, DEFAULT_MAX_BYTES, CaptureError, CaptureWriter

__all__ = ["CaptureError", "CaptureWriter", "ChunkRecorder", "DEFAULT_KEEP", "DEFAULT_MAX_BYTES", "request_hash"]
