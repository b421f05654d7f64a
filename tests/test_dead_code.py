"""No function, method or class that nothing calls: vulture over the packages, with the tests,
benches and examples counted as callers. A name only a framework calls goes into
FRAMEWORK_HOOKS with the framework that calls it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["agent", "collector", "hook", "models", "src"]
CALLERS = ["tests", "bench", "examples"]
KINDS = ("function", "method", "property", "class")
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
}


def test_nothing_is_defined_that_nothing_uses() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vulture", *PACKAGES, *CALLERS, "--min-confidence", "60",
         "--ignore-names", ",".join(FRAMEWORK_HOOKS)],
        cwd=ROOT, capture_output=True, text=True, check=False,
    ).stdout
    dead = [line for line in out.splitlines()
            if any(f"unused {kind} " in line for kind in KINDS)
            and not line.startswith(tuple(f"{c}/" for c in CALLERS))]
    assert not dead, ("defined but never used (delete it, or name the framework that calls it "
                      "in FRAMEWORK_HOOKS):\n" + "\n".join(dead))
