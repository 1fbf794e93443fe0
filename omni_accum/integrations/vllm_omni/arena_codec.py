"""``OmniAccumArenaConnector``'s payload encoding: vllm-omni's own msgpack encoding (what
``SharedMemoryConnector`` puts), except that tensor bytes travel in arena pages instead of the message.

Sending, each tensor is copied once into fresh pages (or, for keys the sending policy appends, behind the
request's rows in its append chain: :mod:`.arena_chains`). Receiving, a tensor of at least ``view_min``
bytes comes out as a tensor over its pages, no copy (:meth:`~omni_accum.arena.views.ChainViews.tensor_view`:
the pages stay that tensor's until no tensor over them is left, then go back to the sender); a smaller one
is copied out and its pages given back at once. See docs/arena.md, "Zero-copy receive".
"""

from __future__ import annotations

from typing import Any

import torch
from vllm_omni.distributed.omni_connectors.utils import serialization as _ser

from omni_accum.arena._common import DTYPES
from omni_accum.integrations.vllm_omni.arena_chains import DTYPE_NAMES, IN_CHAIN, cpu_contiguous, tensor_ref
from omni_accum.integrations.vllm_omni.arena_settings import DEFAULT_VIEW_BYTES  # noqa: F401 - re-exported

#: Key of a tensor's wire dict (vllm-omni's own tensor encoding) that says where its bytes are in the arena.
IN_ARENA = "__omni_accum_arena__"


class Encoder(_ser.OmniMsgpackEncoder):
    """vllm-omni's own payload encoding, each tensor's bytes written into arena pages by ``tx``."""

    def __init__(self) -> None:
        super().__init__()
        self.tx: Any = None
        self.spans: list[tuple[int, int]] = []
        self.tensor_bytes = 0

    def _encode_tensor(self, tensor: torch.Tensor) -> dict[str, Any]:
        if tensor.dtype not in DTYPE_NAMES or tensor.is_sparse or not tensor.numel():
            return super()._encode_tensor(tensor)
        t = cpu_contiguous(tensor)
        page, n = self.tx.write_tensor(t)
        self.spans.append((page, n))
        self.tensor_bytes += t.numel() * t.element_size()
        return tensor_ref(t, list(tensor.shape), IN_ARENA, page)


class Decoder(_ser.OmniMsgpackDecoder):
    """vllm-omni's own payload decoding from the arena of ``rx``: a tensor of at least ``view_min`` bytes as
    a tensor over its pages (None: every tensor copied out), a smaller one copied out; rows of append chains
    as views of their slabs. ``spans`` holds the pages of the message being decoded (first page -> pages);
    the pages of the tensors handed out over them are taken out of it, the caller frees the rest."""

    def __init__(self, view_min: int | None = DEFAULT_VIEW_BYTES) -> None:
        super().__init__()
        self.rx: Any = None
        self.view_min = view_min
        self.chains: dict[int, tuple[int, torch.Tensor]] = {}  # the chains' slabs the message being decoded names
        self.spans: dict[int, int] = {}
        self.views = self.copies = 0  # tensors handed out over arena pages / copied out of them

    def _decode_tensor(self, obj: dict[str, Any]) -> torch.Tensor:
        page = obj.get(IN_ARENA)
        if page is None:
            chain = obj.get(IN_CHAIN)
            if chain is not None:
                return self.rx.chain_rows(self.chains, *chain)
            return super()._decode_tensor(obj)
        dtype, shape = DTYPES[obj["dtype"]], obj["shape"]
        if self.view_min is not None:
            nbytes = dtype.itemsize
            for d in shape:
                nbytes *= d
            if nbytes >= self.view_min:
                npages = self.spans.pop(page, None)
                if npages is not None:  # (a page named twice is copied the second time)
                    self.views += 1
                    return self.rx.tensor_view(page, npages, dtype, shape)
        self.copies += 1
        return self.rx.read_tensor(page, dtype, shape)
