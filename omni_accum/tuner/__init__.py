"""The auto-tuner: measure every applicable strategy per key on a workload, per context length x
concurrency bucket, and write the fastest policy (``omni-accum tune``)."""

from omni_accum.tuner.run import TuneOptions, TuneResult, tune, write_atomic

__all__ = ["TuneOptions", "TuneResult", "tune", "write_atomic"]
