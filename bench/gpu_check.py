"""The Python steps of bench/gpu_check.sh, the one-command check on a CUDA machine without a
network (docs/benchmarks.md, "GPU check").

    python3 bench/gpu_check.py prepare [--dest .gpu-check]   here, with a network
    python3 bench/gpu_check.py environment                    there: what the machine has
    python3 bench/gpu_check.py model SRC DEST                 there: the served checkpoint

``prepare`` writes into the gitignored ``.gpu-check/`` what the run carries:

* ``requirements.txt``: docker/requirements.py's ``--gpu-check`` subset of the project's
  pinned requirements (pyproject.toml, tool.tandem.gpu-check-dependencies), and
  transformers pinned to the release in ``wheels/`` (``PINNED``);
* ``wheels/``: those requirements and their dependencies as wheels for the machine's
  Python (CPython 3.12, manylinux x86-64), torch left out (the machine's CUDA build
  serves), and the large wheels of distributions the machine's image already holds in
  versions that satisfy them (``ON_THE_MACHINE``, from the image's package list) dropped,
  so the whole stays under the 64 MiB a device call carries;
* ``smollm2-shape/``: SmolLM2-135M-Instruct's config, tokenizer and chat template (~3.5 MB;
  its weights, 270 MB, cannot travel). ``model`` gives it random weights there.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEST = REPO / ".gpu-check"
PYTHON_VERSION = "3.12"  # the device image's python3 (KINDS.md: 3.12.3)
# pip matches manylinux tags exactly: every glibc level up to the image's (Ubuntu 24.04)
PLATFORMS = [*(f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 27, 28, 31, 34, 35, 39)),
             "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
# Held by the device image (KINDS.md, package list of 2026-11-17; numpy 2.5.2, tokenizers
# 0.23.2, safetensors 0.8.0 as read there), each > 0.5 MB as a wheel: left behind.
ON_THE_MACHINE = ("numpy", "pillow", "hf-xet", "tokenizers", "pygments", "regex", "pyyaml",
                  "safetensors")
# The tests' reference implementation: the release the wheels hold (what the tests were last
# run against here), not whichever the image has (5.17 when last read), whose APIs the tests
# may not match.
PINNED = ("transformers",)
CARRY_LIMIT = 64 << 20  # what one device call carries, working tree included
SMOLLM2_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja")


def distribution(wheel: Path) -> str:
    """A wheel file's distribution name, normalized as PEP 503 does."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-", 1)[0]).lower()


def prepare(dest: Path) -> None:
    dest.mkdir(exist_ok=True)
    reqs = subprocess.run([sys.executable, str(REPO / "docker" / "requirements.py"),
                           "--gpu-check", str(REPO / "pyproject.toml")],
                          check=True, capture_output=True, text=True).stdout.split()
    wheels = dest / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(wheels),
                    "--only-binary=:all:", "--python-version", PYTHON_VERSION,
                    "--implementation", "cp", *platforms,
                    *(r for r in reqs if not r.startswith("torch"))], check=True)
    for wheel in wheels.glob("*.whl"):
        if distribution(wheel) in ON_THE_MACHINE:
            wheel.unlink()
        elif distribution(wheel) in PINNED:
            reqs.append(f"{distribution(wheel)}=={wheel.name.split('-')[1]}")
    (dest / "requirements.txt").write_text("\n".join(reqs) + "\n")
    from tandem_testing.hf_models import smollm2_dir  # builds .cache/ once (network)

    shape = dest / "smollm2-shape"
    shape.mkdir(exist_ok=True)
    for name in SMOLLM2_FILES:
        shutil.copy(smollm2_dir() / name, shape / name)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout.split("\0")
    tracked = sum((REPO / f).stat().st_size for f in listed if f and (REPO / f).is_file())
    print(f"{dest}: {len(list(wheels.glob('*.whl')))} wheels and SmolLM2's files, "
          f"{size / 2**20:.1f} MiB; with the working tree ({tracked / 2**20:.1f} MiB) "
          f"{(size + tracked) / 2**20:.1f} of the {CARRY_LIMIT >> 20} MiB a call carries")
    if size + tracked > CARRY_LIMIT:
        raise SystemExit("too large for one device call: leave more wheels behind")


def environment() -> None:
    """What the machine brought: torch, CUDA, the GPU, and the versions the install kept."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    print(f"python {platform.python_version()} ({sys.executable})  torch {torch.__version__}"
          f"  CUDA {torch.version.cuda}  cuDNN {torch.backends.cudnn.version()}"
          f"  cores {os.cpu_count()}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability "
              f"{p.major}.{p.minor}, {p.multi_processor_count} SMs")
    if not torch.cuda.is_available():
        print("gpu: none (torch.cuda.is_available() is False)")
    lines = (DEST / "requirements.txt").read_text().split()
    found = []
    for name in dict.fromkeys(re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in lines):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} MISSING")
    print("installed: " + ", ".join(found))


def model(src: Path, dest: Path) -> None:
    """A random checkpoint of ``src``'s config (transformers' own initialization, seeded),
    bf16 safetensors, with ``src``'s tokenizer and chat template."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(src)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(
        dest)
    for name in SMOLLM2_FILES:
        if name != "config.json":
            shutil.copy(src / name, dest / name)
    print(f"{dest}: random weights of {src.name}'s shape "
          f"({sum(f.stat().st_size for f in dest.iterdir()) / 2**20:.0f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare").add_argument("--dest", type=Path, default=DEST)
    sub.add_parser("environment")
    m = sub.add_parser("model")
    m.add_argument("src", type=Path)
    m.add_argument("dest", type=Path)
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.dest)
    elif args.command == "environment":
        environment()
    else:
        model(args.src, args.dest)


if __name__ == "__main__":
    main()
