"""Fetches the wheels the GPU machine lacks into ``.wheels/`` (git-ignored), and prints the kit's command line.

The device machines (see docs/development.md, "The GPU kit") have PyTorch, Lightning, torchmetrics, timm, scipy
and tensorboard, but not opacus, segmentation-models-pytorch, jsonargparse, MONAI or dp-accounting, and reach no
package registry: those travel with the working tree as wheels (``carry: [".wheels"]``), for CPython 3.12 on
manylinux x86-64. Their requirements are followed (extras only where the project asks for them) and each one not
in ``device_packages.txt`` (the machine's package list) is fetched too. Versions are the ones installed where this
script runs (the versions the test suite passes with here), else the newest.

One version of each package is kept (pip refuses two), the total size is checked against ``--max-mib`` (the
working tree that travels is limited to 64 MiB, the tree itself included), and the command line
(``benchmarks/device/COMMAND``, at most 2,000 characters) is printed with its length.

Run: .venv/bin/python benchmarks/device/fetch_wheels.py [--dest .wheels] [--max-mib 40]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
COMMAND = HERE / "COMMAND"
#: What the kit imports that the machine lacks, with the extras the project uses.
WANTED = ("opacus", "segmentation-models-pytorch", "jsonargparse[signatures]", "monai", "dp-accounting")
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64"]
#: The device's Python: markers of requirements are evaluated for it.
DEVICE_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython"}
DEVICE_PYTHON |= {"platform_machine": "x86_64", "sys_platform": "linux", "platform_system": "Linux"}
DEVICE_PYTHON |= {"os_name": "posix", "platform_python_implementation": "CPython"}


def present_on_device(path: Path = HERE / "device_packages.txt") -> set[str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    return {canonicalize_name(line) for line in lines if line and not line.startswith("#")}


def local_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def download(name: str, dest: Path) -> None:
    version = local_version(name)
    spec = f"{name}=={version}" if version else name
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run([*command, spec], check=True)


def wheel_of(name: str, dest: Path) -> Path:
    found = [w for w in dest.glob("*.whl") if parse_wheel_filename(w.name)[0] == canonicalize_name(name)]
    if len(found) != 1:
        raise SystemExit(f"{name}: expected one wheel in {dest}, found {[w.name for w in found]}")
    return found[0]


def requirements(wheel: Path, extras: set[str]) -> list[Requirement]:
    """The wheel's requirements that apply on the device (Python 3.12, Linux) with ``extras``."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        env = default_environment() | DEVICE_PYTHON
        if req.marker is None or any(req.marker.evaluate(env | {"extra": e}) for e in (extras or {""})):
            out.append(req)
    return out


def fetch(dest: Path) -> list[str]:
    """Downloads the closure of `WANTED` minus what the device has; returns the canonical names fetched."""
    dest.mkdir(exist_ok=True)
    have = present_on_device()
    queue = [Requirement(spec) for spec in WANTED]
    fetched: dict[str, set[str]] = {}
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in have or (name in fetched and req.extras <= fetched[name]):
            continue
        if name not in fetched:
            download(req.name, dest)
        fetched[name] = fetched.get(name, set()) | set(req.extras)
        queue += requirements(wheel_of(name, dest), fetched[name])
    for wheel in dest.glob("*.whl"):  # one version of each, nothing else: two versions stop the install there
        if parse_wheel_filename(wheel.name)[0] not in fetched:
            wheel.unlink()
    for name in fetched:
        wheel_of(name, dest)
    return sorted(fetched)


def command_line() -> str:
    """The kit's command line (``COMMAND``, one line): installs the wheels, then runs the driver."""
    return COMMAND.read_text().strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", default=str(ROOT / ".wheels"))
    parser.add_argument("--max-mib", type=float, default=40.0, help="refuse a larger set (the tree travels too)")
    args = parser.parse_args()
    dest = Path(args.dest)
    names = fetch(dest)
    wheels = sorted(dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels) / 2**20
    for w in wheels:
        print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
    print(f"{len(wheels)} wheels ({', '.join(names)}): {total:.1f} MiB in {dest}")
    if total > args.max_mib:
        raise SystemExit(f"the wheels take {total:.1f} MiB, over --max-mib {args.max_mib}: the tree may not travel")
    command = command_line()
    if "\n" in command or len(command) > 2000 or not re.search(r"\.wheels/\*\.whl", command):
        raise SystemExit(f"{COMMAND} must be one line of at most 2,000 characters installing .wheels/*.whl")
    print(f'\nThe command ({len(command)} characters; run it with carry [".wheels"], timeout_s 600):\n{command}')


if __name__ == "__main__":
    main()
