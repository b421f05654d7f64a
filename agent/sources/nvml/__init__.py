"""The ``nvml`` GPU source: NVIDIA's management library through nvidia-ml-py.

This package is the only code in forewarn that imports :mod:`pynvml` (the hardware
seam: :mod:`.backend` samples, :mod:`.fields` says what to ask and how to read it,
:mod:`.events` waits for XIDs). It turns NVML's answers into
:class:`forewarn.wire.GpuSample` records and NVML error codes into the typed outcomes
of :mod:`forewarn.agent.backend`:

* ``NVML_ERROR_NOT_SUPPORTED`` (and ``FUNCTION_NOT_FOUND`` from an older driver): the
  field is listed in ``GpuSample.unsupported`` and never asked again for that GPU.
* ``NVML_ERROR_GPU_IS_LOST`` / ``NVML_ERROR_RESET_REQUIRED``: the GPU's sample has
  ``state`` ``lost`` / ``reset_required``; the other GPUs keep sampling and the GPU is
  tried again at the next poll.
* any other error of one field: a ``"field: reason"`` entry in ``GpuSample.errors``.
* a value at NVML's "not available" sentinel (:data:`NVML_VALUE_NOT_AVAILABLE`,
  :data:`.fields.NVML_PSTATE_UNKNOWN`): the field is missing (``None``) in that sample.
* no library / no kernel driver at :meth:`NvmlBackend.open`:
  :class:`~forewarn.agent.backend.SourceUnavailable` with a message that says so.

Cost per poll and GPU: one ``nvmlDeviceGetFieldValues`` call for the ECC, retired-page,
row-remap, PCIe-replay, memory-temperature and per-link NVLink counters (NVML_FI_DEV_*),
plus one call per remaining getter. Handles, field lists and static facts (max PCIe link,
slowdown threshold, NVLink link count) are read once in :meth:`NvmlBackend.open`.

XID errors arrive through an NVML event set (``nvmlEventTypeXidCriticalError``) waited
on by a daemon thread with a timeout, so :meth:`NvmlBackend.close` ends it promptly.

NVML entry points used (for the record of what a driver must provide):
``nvmlInitWithFlags``, ``nvmlShutdown``, ``nvmlSystemGetDriverVersion``,
``nvmlDeviceGetCount_v2``, ``nvmlDeviceGetHandleByIndex_v2``, ``nvmlDeviceGetName``,
``nvmlDeviceGetUUID``, ``nvmlDeviceGetPciInfo_v3``, ``nvmlDeviceGetSerial``,
``nvmlDeviceGetTemperature``, ``nvmlDeviceGetTemperatureThreshold``,
``nvmlDeviceGetMarginTemperature``, ``nvmlDeviceGetPowerUsage``,
``nvmlDeviceGetEnforcedPowerLimit``, ``nvmlDeviceGetClockInfo``,
``nvmlDeviceGetUtilizationRates``, ``nvmlDeviceGetMemoryInfo``,
``nvmlDeviceGetCurrentClocksEventReasons``, ``nvmlDeviceGetPerformanceState``,
``nvmlDeviceGetCurrPcieLinkGeneration``, ``nvmlDeviceGetCurrPcieLinkWidth``,
``nvmlDeviceGetMaxPcieLinkGeneration``, ``nvmlDeviceGetMaxPcieLinkWidth``,
``nvmlDeviceGetTotalEnergyConsumption``,
``nvmlDeviceGetFieldValues``, ``nvmlDeviceGetNvLinkErrorCounter`` (links 12 and up only),
``nvmlEventSetCreate``, ``nvmlDeviceGetSupportedEventTypes``, ``nvmlDeviceRegisterEvents``,
``nvmlEventSetWait_v2``, ``nvmlEventSetFree``, ``nvmlErrorString``.
"""

from __future__ import annotations

from forewarn.agent.sources.nvml.backend import NvmlBackend

__all__ = ["NvmlBackend"]
