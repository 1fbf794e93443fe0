"""The ``omni-accum`` command line (console script ``omni_accum.cli:main``).

One module per command family, each exposing ``register(subparsers)``:

* :mod:`~omni_accum.cli.policy`: ``strategies``, ``validate``, ``explain``, ``show``;
* :mod:`~omni_accum.cli.bench`: ``bench``;
* :mod:`~omni_accum.cli.tune`: ``tune``;

:mod:`~omni_accum.cli.args` holds the argument types they share, :mod:`~omni_accum.cli.main`
the parser and :func:`main`.
"""

from __future__ import annotations

import os

# vLLM logs to stdout unless told otherwise, and bench, tune and doctor import it: its lines go to stderr,
# so what a command prints on stdout (a table, a policy, --json) is only its own.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

from omni_accum.cli.main import build_parser, main  # noqa: E402

__all__ = ["build_parser", "main"]
