"""No function, method, class or variable that nothing uses: vulture over the packages, with
the tests, benches and examples counted as callers. A name only a framework calls or reads
goes into FRAMEWORK_HOOKS with the framework; a field read only as data (``asdict`` into
JSON, ``getattr`` by name) into READ_AS_DATA with where it is read."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["agent", "collector", "hook", "models", "src"]
CALLERS = ["tests", "bench", "examples"]
KINDS = ("function", "method", "property", "class", "variable", "attribute")
FRAMEWORK_HOOKS = {
    "describe": "prometheus_client: CollectorRegistry.register",
    "do_GET": "http.server.BaseHTTPRequestHandler",
    "log_message": "http.server.BaseHTTPRequestHandler",
    "load_bytes": "torch.distributed.checkpoint LoadPlanner (the weights_only=True override)",
    "on_train_begin": "transformers.TrainerCallback",
    "on_step_end": "transformers.TrainerCallback",
    "on_log": "transformers.TrainerCallback",
    "on_save": "transformers.TrainerCallback",
    "on_train_end": "transformers.TrainerCallback",
    "setup": "lightning Callback",
    "on_train_batch_end": "lightning Callback",
    "teardown": "lightning Callback",
    "pl_module": "lightning Callback (hook signatures)",
    "batch_idx": "lightning Callback (hook signatures)",
    "protocol_version": "http.server.BaseHTTPRequestHandler (HTTP/1.1 keep-alive)",
    "daemon_threads": "socketserver.ThreadingMixIn (handler threads do not block exit)",
    "should_exit": "uvicorn.Server (set to stop it)",
    "should_save": "transformers.TrainerControl (the Trainer saves when set)",
    "row_factory": "sqlite3.Connection (rows as sqlite3.Row)",
    "fieldId": "pynvml c_nvmlFieldValue_t (ctypes struct NVML reads)",
    "scopeId": "pynvml c_nvmlFieldValue_t (ctypes struct NVML reads)",
    "_lib": "ctypes.CDLL held so the library stays loaded for pynvml (nvml backend)",
}
READ_AS_DATA = {
    "probability_source": "collector decisions API (CostDecision.as_dict)",
    "risk_gpu": "GET /api/v1/goodput advice (JobAdvice through dataclasses.asdict)",
    "notices_absorbed": "hook Monitor.stats() (MonitorStats, public API)",
    "true_alarms": "forewarn_model_shadow_* metrics (ShadowStats read with getattr)",
    "max_gap_s": "chaos outcome figures (Account.as_dict)",
    "resumed_ranks": "forewarn demo --json (DemoResult through dataclasses.asdict)",
    "nan_detected_latency_s": "forewarn demo --json (DemoResult through dataclasses.asdict)",
}


def test_nothing_is_defined_that_nothing_uses() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vulture", *PACKAGES, *CALLERS, "--min-confidence", "60",
         "--ignore-names", ",".join([*FRAMEWORK_HOOKS, *READ_AS_DATA])],
        cwd=ROOT, capture_output=True, text=True, check=False,
    ).stdout
    dead = [line for line in out.splitlines()
            if any(f"unused {kind} " in line for kind in KINDS)
            and not line.startswith(tuple(f"{c}/" for c in CALLERS))]
    assert not dead, ("defined but never used (delete it, or name the framework that uses it "
                      "in FRAMEWORK_HOOKS, or where it is read in READ_AS_DATA):\n"
                      + "\n".join(dead))
