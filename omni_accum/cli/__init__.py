"""The ``omni-accum`` command line (console script ``omni_accum.cli:main``).

One module per command family, each exposing ``register(subparsers)``:

* :mod:`~omni_accum.cli.policy`: ``strategies``, ``validate``, ``explain``, ``show``;
* :mod:`~omni_accum.cli.bench`: ``bench``;
* :mod:`~omni_accum.cli.tune`: ``tune``;

:mod:`~omni_accum.cli.args` holds the argument types they share, :mod:`~omni_accum.cli.main`
the parser and :func:`main`.
"""

from __future__ import annotations

from omni_accum.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
