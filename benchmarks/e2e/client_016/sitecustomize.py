"""CPU stand-in for ffmpeg in vllm-omni 0.16.0's benchmark client (``run.py --release 0.16`` puts this folder
first on the client's ``PYTHONPATH``, never the server's).

0.16.0's ``openai-chat-omni`` backend decodes every audio chunk with ``pydub.AudioSegment.from_file(BytesIO)``
and no format, which runs ffmpeg / ffprobe; this host has neither, and each request then counts as failed.
The server's chunks are WAV (``RIFF....WAVE``): those are read with pydub's own WAV reader, as
``format="wav"`` does. Anything else goes to pydub unchanged.
"""

from __future__ import annotations

import io

try:
    from pydub import AudioSegment
except ImportError:  # not the benchmark client's environment
    AudioSegment = None


def is_wav(file) -> bool:
    if not isinstance(file, io.BytesIO):
        return False
    head = file.getvalue()[:12]
    return head[:4] == b"RIFF" and head[8:12] == b"WAVE"


if AudioSegment is not None and not getattr(AudioSegment.from_file, "_omni_accum_e2e", False):
    _from_file = AudioSegment.from_file.__func__

    def from_file(cls, file, format=None, *args, **kwargs):
        if format is None and is_wav(file):
            format = "wav"
        return _from_file(cls, file, format, *args, **kwargs)

    from_file._omni_accum_e2e = True
    AudioSegment.from_file = classmethod(from_file)
