"""vllm-omni release families (0.16, 0.28, 0.30): the registry, activation's choice, and lockstep runs.

The lockstep tests are parametrised by family and run for the installed release (the other family's
cases skip, naming the installed release): every chunk of a random stream goes through the
release's own runner ``_accumulate_payload`` (no omni-accum) and through the same class with
omni-accum installed under the ``default`` policy; the consumer's view must be equal after every
chunk. The streams carry what the two releases treat differently: ``embed.decode`` token spans
(contiguous, overlapping, duplicate, gapped, empty), which 0.28's runner mixin and 0.30's MRv2 data
plane merge by span and 0.30's transport mixin does not. ``bash scripts/test.sh`` runs this file
in both environments (.venv: 0.30.0, .venv-028: 0.28.0).
"""

from __future__ import annotations

import random
from importlib.metadata import version
from typing import Any

import pytest
import torch

from omni_accum.integrations.vllm_omni import families
from tests.conftest import runner_config
from tests.test_integration_vllm_omni import assert_same

H = 8  # hidden size: small, the rules do not depend on it
FAMILY_NAMES = [f.name for f in families.FAMILIES]


# ---------------------------------------------------------------------------------------------- #
# The registry (no vllm-omni needed)
# ---------------------------------------------------------------------------------------------- #


def test_registry_lists_every_release():
    assert families.SUPPORTED_VERSIONS == ("0.16.0", "0.28.0", "0.30.0")
    assert families.family_for("0.16.0").name == "0.16"
    assert families.family_for("0.28.0").name == "0.28"
    assert families.family_for("0.30.0").name == "0.30"
    assert families.family_for("0.30.0+cpu").name == "0.30"  # a local build label is the same release
    assert families.family_for("0.29.0") is None and families.family_for(None) is None
    assert families.by_name("0.28").version == "0.28.0" and families.by_name("0.30.0").name == "0.30"
    with pytest.raises(KeyError, match="0.16.0, 0.28.0, 0.30.0"):
        families.by_name("0.26")


def test_tables_differ_where_the_releases_do():
    old, new = families.by_name("0.28"), families.by_name("0.30")
    adapter = lambda f: [(t.owner, t.name, t.signature) for t in f.targets if "OmniChunkTransferAdapter" in t.owner]  # noqa: E731
    assert adapter(old) == adapter(new) and len(adapter(old)) == 5  # __init__ (the hello) and four methods
    accumulate = lambda f: {t.owner.rpartition(":")[2] for t in f.targets if t.name == "_accumulate_payload"}  # noqa: E731
    assert accumulate(old) == {"OmniConnectorModelRunnerMixin"}
    assert accumulate(new) == {"_OmniConnectorPayloadTransportMixin", "OmniRunnerDataPlane"}
    assert [o.rpartition(":")[2] for o in old.span_merge] == ["OmniConnectorModelRunnerMixin"]
    assert [o.rpartition(":")[2] for o in new.span_merge] == ["OmniRunnerDataPlane"]
    assert old.data_plane is None and new.data_plane is not None
    # the Qwen3-Omni thinker-to-talker processor (a module-level function): the same in both
    proc = lambda f: [(t.owner, t.signature) for t in f.targets if t.name == "thinker2talker_async_chunk"]  # noqa: E731
    assert proc(old) == proc(new) and len(proc(old)) == 1
    assert proc(old)[0][1] == "(transfer_manager, multimodal_output, request, is_finished=False)"
    assert not old.empty_span_takes_incoming and new.empty_span_takes_incoming
    (init_old,) = [t for t in old.probes if t.name == "init_omni_connectors"]
    (init_new,) = [t for t in new.probes if t.name == "init_omni_connectors"]
    assert init_old.signature == "(self, model_config, kv_transfer_manager=None)"
    assert "synchronous=False" in init_new.signature


def test_doctor_uses_the_registry():
    from omni_accum.cli import doctor

    assert tuple(doctor.SUPPORTED_VLLM_OMNI) == families.SUPPORTED_VERSIONS


# ---------------------------------------------------------------------------------------------- #
# Activation's choice (real vllm-omni)
# ---------------------------------------------------------------------------------------------- #


def test_installed_release_is_chosen(vo):
    fam = families.family_for(version("vllm-omni"))
    assert fam is not None, f"vllm-omni {version('vllm-omni')} is not supported"
    assert vo.SUPPORTED_VERSION == fam.version and vo.TARGETS == fam.targets and vo.PROBES == fam.probes
    assert vo.check_signatures() == []
    vo.install("default")
    assert vo.active_family() is fam and vo.is_installed()
    for t in fam.targets:
        raw = vo._resolve(t.owner).__dict__[t.name]
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw
        assert getattr(fn, "__omni_accum_original__", None) is not None, t.label
    vo.uninstall()
    assert vo.active_family() is None and not vo.is_installed()


def test_unknown_release_is_refused_naming_it(vo, monkeypatch):
    raw = {t: vo._resolve(t.owner).__dict__[t.name] for t in vo.TARGETS + vo.PROBES}
    monkeypatch.setattr(families, "installed_version", lambda dist="vllm-omni": "0.29.0")
    with pytest.raises(vo.InstallRefused) as ei:
        vo.install("default")
    msg = str(ei.value)
    assert "vllm-omni 0.29.0 is not a supported release" in msg and "0.16.0, 0.28.0, 0.30.0" in msg
    assert "nothing was patched" in msg
    assert vo.check_signatures() == [families.unsupported_message("0.29.0")]
    monkeypatch.setenv("OMNI_ACCUM_POLICY", "default")
    vo.activate()  # logs the refusal, patches nothing (probes neither)
    assert {t: vo._resolve(t.owner).__dict__[t.name] for t in raw} == raw and not vo.is_installed()


def test_missing_vllm_omni_is_refused(vo, monkeypatch):
    monkeypatch.setattr(families, "installed_version", lambda dist="vllm-omni": None)
    with pytest.raises(vo.InstallRefused, match="not installed; omni-accum supports vllm-omni 0.16.0, 0.28.0, 0.30.0"):
        vo.install("default")
    assert not vo.is_installed()


def test_version_and_probe_must_agree(vo, monkeypatch):
    """The version says the other release; its methods are not there: the probe refuses, nothing patched."""
    installed = families.family_for(version("vllm-omni"))
    other = next(f for f in families.FAMILIES if f is not installed)
    raw = {t: vo._resolve(t.owner).__dict__[t.name] for t in installed.targets}
    monkeypatch.setattr(families, "installed_version", lambda dist="vllm-omni": other.version)
    with pytest.raises(vo.InstallRefused) as ei:
        vo.install("default")
    msg = str(ei.value)
    assert f"family {other.name}, expects vllm-omni {other.version}" in msg and "Refusing to install" in msg
    assert {t: vo._resolve(t.owner).__dict__[t.name] for t in raw} == raw and not vo.is_installed()


# ---------------------------------------------------------------------------------------------- #
# Lockstep: the installed release's own code vs omni-accum under ``default``
# ---------------------------------------------------------------------------------------------- #


def installed_family(name: str, runner: bool = True) -> families.Family:
    """The family ``name`` when it is the installed release's (else skip); ``runner``: the test needs the
    runner transport, which 0.16 does not have (its adapter accumulates: test_integration_vllm_omni_v016.py)."""
    fam = families.by_name(name)
    have = version("vllm-omni")
    if not fam.covers(have):
        pytest.skip(f"vllm-omni {have} is installed; family {name} runs in its own environment (scripts/test.sh)")
    if runner and fam.name == "0.16":
        pytest.skip("vllm-omni 0.16.0 has no runner transport (its chunk adapter accumulates the whole payload)")
    return fam


def make_transport(owner: str) -> Any:
    """A real runner transport of class ``owner`` (a runner mixin with a SharedMemoryConnector, or a data plane)."""
    from types import SimpleNamespace

    from omni_accum.integrations.vllm_omni.families.base import _resolve

    cls = _resolve(owner)
    if cls.__name__ == "OmniRunnerDataPlane":
        return cls(SimpleNamespace(), runner_config())
    from vllm_omni.worker.omni_connector_model_runner_mixin import OmniConnectorModelRunnerMixin

    r = type("Runner", (OmniConnectorModelRunnerMixin,), {})()
    r.init_omni_connectors(runner_config())
    return r


def close_transport(t: Any) -> None:
    if hasattr(t, "shutdown_omni_connectors"):
        t.shutdown_omni_connectors()
    else:
        t.close()


def random_stream(seed: int) -> list[dict]:
    """A thinker -> talker stream: a prefill chunk, then decode chunks whose token spans are
    contiguous, overlapping, fully duplicate, gapped, empty, or absent; lists, statics, flags and
    ``meta.override_keys`` on the way."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rows = lambda n: torch.randn(n, H, generator=g).bfloat16()  # noqa: E731
    first: dict = {"embed": {"prefill": rows(rnd.randint(1, 6)), "tts_bos": rows(1)}, "ids": {"prompt": [1, 2, 3]}}
    if rnd.random() < 0.7:
        n0 = rnd.randint(0, 2)
        first["embed"].update(decode=rows(n0), decode_token_start=0, decode_token_end=n0)
    out = [first]
    pos = first["embed"].get("decode_token_end", 0)
    for _ in range(rnd.randint(3, 24)):
        chunk: dict = {"meta": {"finished": torch.tensor(False)}}
        mode = rnd.choice(["contiguous"] * 5 + ["overlap", "duplicate", "gap", "empty", "plain", "none"])
        n = rnd.randint(1, 3)
        if mode == "contiguous":
            start = pos
        elif mode == "overlap":
            start = max(0, pos - rnd.randint(1, 2))
            n = max(n, pos - start + 1)
        elif mode == "duplicate":
            start, n = max(0, pos - 1), min(1, pos)
        elif mode == "gap":
            start = pos + rnd.randint(1, 3)
        elif mode == "empty":
            start, n = pos, 0
        if mode == "plain":
            chunk["embed"] = {"decode": rows(n)}
        elif mode != "none":
            chunk["embed"] = {"decode": rows(n), "decode_token_start": start, "decode_token_end": start + n}
            pos = max(pos, start + n)
        if rnd.random() < 0.5:
            chunk.setdefault("ids", {})["output"] = [rnd.randint(0, 99) for _ in range(rnd.randint(1, 2))]
        if rnd.random() < 0.3:
            chunk.setdefault("hidden_states", {})["output"] = torch.randn(rnd.randint(1, 2), H, generator=g)
        if rnd.random() < 0.15:
            chunk["meta"]["override_keys"] = [["embed", "decode"]]
        if rnd.random() < 0.2:
            chunk["speaker"] = "Ethan"
        out.append(chunk)
    out[-1]["meta"]["finished"] = torch.tensor(True)
    return out


def _span(view: dict) -> tuple:
    emb = view.get("embed", {})
    shape = tuple(emb["decode"].shape) if "decode" in emb else None
    return emb.get("decode_token_start"), emb.get("decode_token_end"), shape


@pytest.mark.vllm
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_default_policy_runner_lockstep(vo, name):
    """Every runner ``_accumulate_payload`` the family wraps: upstream and omni-accum (``default``)
    chunk by chunk on 40 random streams; the hook's state is released where upstream releases."""
    fam = installed_family(name)
    owners = [t.owner for t in fam.targets if t.name == "_accumulate_payload"]
    assert owners and set(fam.span_merge) <= set(owners)
    spans_seen = 0
    for owner in owners:
        up = make_transport(owner)  # upstream's side: always called through the original (_upstream)
        vo.install("default")
        ours = make_transport(owner)
        try:
            for seed in range(40):
                rid = f"{name}-{seed}"
                for k, chunk in enumerate(random_stream(seed)):
                    want = _upstream(up, owner, rid, chunk)
                    got = ours._accumulate_payload(rid, _copy(chunk))
                    assert_same(got, want, f"{owner.rpartition(':')[2]} seed {seed} chunk {k}")
                    spans_seen += owner in fam.span_merge and _span(want)[0] is not None
                b = ours._omni_accum_binding
                assert b is not None and rid in b.receiver.request_ids()
                ours._send_side_request_payload.pop(rid)  # upstream's release point
                up._send_side_request_payload.pop(rid)
                assert rid not in b.receiver.request_ids()
            assert b.receiver.active_requests == 0 and not b.fell_back
        finally:
            vo.uninstall()
            close_transport(up)
            close_transport(ours)
    assert spans_seen > 100  # the span rule was exercised, not only the generic merge


def _copy(chunk: dict) -> dict:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in chunk.items()}


def _upstream(t: Any, owner: str, rid: str, chunk: dict) -> dict:
    """The release's own method on ``t``, called through the original even while omni-accum is installed."""
    from omni_accum.integrations.vllm_omni.families.base import _resolve

    fn = _resolve(owner).__dict__["_accumulate_payload"]
    fn = getattr(fn, "__omni_accum_original__", fn)
    return fn(t, rid, _copy(chunk))


@pytest.mark.vllm
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_decode_span_rule_is_the_releases(vo, name):
    """Where the family merges by span, the hook keeps the release's rule: contiguous rows appended,
    overlap trimmed, a duplicate dropped, a gap left to the generic merge (rows concatenated)."""
    fam = installed_family(name)
    (owner,) = fam.span_merge
    span = lambda rows, s: {"embed": {"decode": rows, "decode_token_start": s, "decode_token_end": s + rows.shape[0]}}  # noqa: E731
    r = torch.arange(10 * H, dtype=torch.float32).reshape(10, H).bfloat16()
    chunks = [span(r[0:2], 0), span(r[2:4], 2), span(r[3:6], 3), span(r[4:6], 4), span(r[8:9], 8)]
    vo.install("default")
    t = make_transport(owner)
    try:
        views = [t._accumulate_payload("s", _copy(c)) for c in chunks]
    finally:
        close_transport(t)
        vo.uninstall()
    assert [_span(v) for v in views[:4]] == [(0, 2, (2, H)), (0, 4, (4, H)), (0, 6, (6, H)), (0, 6, (6, H))]
    assert torch.equal(views[3]["embed"]["decode"], r[0:6])
    assert _span(views[4]) == (8, 9, (7, H))  # the gap: generic merge, upstream's documented quirk


@pytest.mark.vllm
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_default_policy_full_payload_lockstep(vo, name):
    """The full-payload accumulator (``async_chunk: false``): upstream and omni-accum (``default``)
    step by step on 20 random step sequences, materialized at the end."""
    fam = installed_family(name)
    owner = next(t.owner for t in fam.targets if t.name == "accumulate_full_payload_output")
    up = make_transport(fam.runner_class)
    vo.install("default")
    ours = make_transport(fam.runner_class)
    try:
        orig = _resolve_original(owner, "accumulate_full_payload_output")
        mat = _resolve_original(owner, "_materialize_full_payload_entry")
        for seed in range(20):
            rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
            for _ in range(rnd.randint(1, 12)):
                step = {
                    "embed.prefill": torch.randn(rnd.randint(1, 3), rnd.choice([H, H, 2 * H]), generator=g),
                    "codes.audio": torch.randint(0, 9, (1, rnd.choice([8, 16]))),
                    "meta.left": rnd.choice([torch.tensor(seed), None, 3]),
                }
                orig(up, "q", dict(step), "REQ")
                ours.accumulate_full_payload_output("q", dict(step), "REQ")
            want = mat(up._pending_full_payload_send.pop("q"))
            got = ours._materialize_full_payload_entry(ours._pending_full_payload_send.pop("q"))
            assert_same(got, want, f"seed {seed}")
    finally:
        vo.uninstall()
        close_transport(up)
        close_transport(ours)


def _resolve_original(owner: str, name: str) -> Any:
    import inspect

    from omni_accum.integrations.vllm_omni.families.base import _resolve

    raw = inspect.getattr_static(_resolve(owner), name)
    fn = raw.__func__ if isinstance(raw, staticmethod) else raw
    return getattr(fn, "__omni_accum_original__", fn)
