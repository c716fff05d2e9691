"""The wheel: the package with its C++ source and PEP 561 marker, nothing from benchmarks/ or tests/."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_wheel_ships_the_package_source_and_marker_only(tmp_path: Path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("lightning_ext-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    (dist_info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    assert {n.split("/")[0] for n in names} == {"lightning_ext", dist_info}
    assert "lightning_ext/csrc/kernels_cpu.cpp" in names and "lightning_ext/py.typed" in names
    assert not [n for n in names if n.startswith(("benchmarks/", "tests/", "notebooks/", "docs/"))]
    assert "License-Expression: Apache-2.0" in metadata
