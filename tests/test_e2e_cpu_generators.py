"""The e2e harness's CPU stand-in runner: a seeded request whose sample a step discards (its prefill not complete)
is rewound the CPU way. vLLM 0.30.0 rewinds it with ``set_offset``, which a CPU generator does not have."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import e2e_cpu_module


@pytest.fixture(scope="module")
def worker():
    yield from e2e_cpu_module(
        "worker",
        ("vllm.v1.worker.cpu_model_runner", "the CPU stand-in runner builds on vLLM's CPU runner"),
        ("vllm_omni.worker.gpu_ar_model_runner", "the CPU stand-in runner builds on vllm-omni's runner"),
    )


def test_a_cpu_generator_has_no_offset_to_rewind():
    """What the stand-in works around (torch's CPU generator), so that the test below means something."""
    with pytest.raises(RuntimeError, match="does not use offset"):
        torch.Generator().get_offset()


class _VLLMLike:
    """The two steps of vLLM 0.30.0's runner that matter: sampling draws from each seeded request's generator,
    then ``_bookkeeping_sync`` rewinds the discarded ones by offset (``gpu_model_runner.py``)."""

    def sample_tokens(self, grammar_output=None):
        for g in self.input_batch.generators.values():
            torch.empty(8).exponential_(generator=g)
        return self._bookkeeping_sync()

    def _bookkeeping_sync(self):
        num_reqs = self.input_batch.num_reqs
        for i in np.nonzero(self.discard_request_mask.np[:num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        return "sampled"


def _runner(worker, cls, discard, seeded):
    class Runner(worker._CPURunnerMixin, cls):
        pass

    r = object.__new__(Runner)  # the mixin's __init__ builds a real runner; only the two steps are under test
    gens = {i: torch.Generator().manual_seed(100 + i) for i in seeded}
    r.input_batch = SimpleNamespace(num_reqs=len(discard), generators=gens)
    r.discard_request_mask = SimpleNamespace(np=np.array(discard + [False] * 4, dtype=bool))
    return r, dict(gens)


@pytest.mark.parametrize(
    "discard, seeded",
    [([True, False], [0, 1]), ([False, True, True], [1, 2]), ([True, True], [1]), ([False, False], [0, 1])],
)
def test_a_discarded_seeded_sample_leaves_its_generator_where_it_was(worker, discard, seeded):
    plain, _ = _runner(worker, _VLLMLike, discard, seeded)
    plain.__class__ = _VLLMLike
    if any(discard[i] for i in seeded):
        with pytest.raises(RuntimeError, match="does not use offset"):
            plain.sample_tokens()  # vLLM's own code on a CPU generator: the crash that stopped a stage
    r, gens = _runner(worker, _VLLMLike, discard, seeded)
    before = {i: g.get_state().clone() for i, g in gens.items()}
    assert r.sample_tokens() == "sampled"
    assert r.input_batch.generators == gens  # every generator back in the batch
    for i, g in gens.items():
        if discard[i]:
            assert torch.equal(g.get_state(), before[i]), i  # rewound: the discarded draw never happened
        else:
            assert not torch.equal(g.get_state(), before[i]), i  # a kept sample advances its stream
    assert r._e2e_rewind == {}


def test_the_runner_classes_put_the_rewind_first(worker):
    for cls in (worker.CPUOmniARModelRunner, worker.CPUOmniGenerationModelRunner):
        mro = cls.__mro__
        assert mro.index(worker._CPURunnerMixin) < min(
            i for i, c in enumerate(mro) if "_bookkeeping_sync" in vars(c) and c is not worker._CPURunnerMixin
        )
