"""Build the FAKE ``libnvidia-ml.so.1`` (``fake_nvml.c``) with gcc, and write its config.

The fake stands only at the hardware seam: nvidia-ml-py's own code runs against it. Used
by ``tests/agent/test_source_nvml.py`` (session fixture, tmp dir) and ``bench/agent_poll.py``.

Command line: ``python tests/fake_nvml/build.py OUT_DIR`` prints the library's path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["SOURCE", "build_fake_nvml", "write_config"]

SOURCE = Path(__file__).with_name("fake_nvml.c")
SONAME = "libnvidia-ml.so.1"


def build_fake_nvml(out_dir: Path) -> Path:
    """Compile the fake into ``out_dir/libnvidia-ml.so.1`` and return its path.

    The SONAME is ``libnvidia-ml.so.1``: once the file is loaded (``ctypes.CDLL(path)``)
    or found through ``LD_LIBRARY_PATH``, pynvml's own ``CDLL("libnvidia-ml.so.1")``
    resolves to it.
    """
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError("no C compiler (gcc) found to build the fake libnvidia-ml.so.1")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / SONAME
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread",
         f"-Wl,-soname,{SONAME}", "-o", str(lib), str(SOURCE)],
        check=True,
        capture_output=True,
        text=True,
    )
    return lib


def write_config(path: Path, text: str) -> None:
    """Replace the fake's config atomically (new inode, so the fake sees the change)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: build.py OUT_DIR")
    print(build_fake_nvml(Path(sys.argv[1])))
