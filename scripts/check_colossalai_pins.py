"""Can ColossalAI join this course's environment? Its published requirements held against requirements.txt.

    python scripts/check_colossalai_pins.py [--version 0.5.0]

Fetches the release's source archive from the package index (pip download: no install, no dependencies), reads the
requirements it installs with, and prints, for every package both name, what ColossalAI asks for, what the course
pins and whether the pin satisfies it. docs/coming_from.md says why ColossalAI is not installed from this output.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[1]


def course_pins(text: str) -> dict[str, str]:
    """``name==version`` lines of a requirements file, by normalised name."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[_normal(name)] = version.strip()
    return pins


def _normal(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def conflicts(requirements: list[str], pins: dict[str, str]) -> list[tuple[str, str, str, bool]]:
    """(package, what the requirement asks, the course's pin, whether the pin satisfies it) for each requirement
    naming a package the course pins."""
    rows = []
    for line in requirements:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        pin = pins.get(_normal(requirement.name))
        if pin is not None:
            rows.append((requirement.name, str(requirement.specifier) or "any", pin,
                         requirement.specifier.contains(pin, prereleases=True)))
    return rows


def published_requirements(version: str) -> list[str]:
    """The lines of requirements/requirements.txt in ColossalAI ``version``'s source archive on the package index."""
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"colossalai=={version}", "-d", folder], check=True, capture_output=True)
        [archive] = Path(folder).glob("colossalai-*.tar.gz")
        with tarfile.open(archive) as tar:
            member = tar.extractfile(f"colossalai-{version}/requirements/requirements.txt")
            return member.read().decode().splitlines()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default="0.5.0", help="the ColossalAI release to check (default: 0.5.0)")
    args = parser.parse_args(argv)
    try:
        published = published_requirements(args.version)
    except (subprocess.CalledProcessError, KeyError):
        print(f"error: ColossalAI {args.version}'s source archive (with requirements/requirements.txt) could not be "
              "fetched from the package index; check the version (pip index versions colossalai) and the network.",
              file=sys.stderr)
        return 2
    rows = conflicts(published, course_pins((REPO_ROOT / "requirements.txt").read_text()))
    width = max(len(name) for name, *_ in rows)
    print(f"{'package':<{width}}  {'ColossalAI ' + args.version + ' asks':<24}  {'course pins':<12}  fits")
    for name, asks, pin, fits in rows:
        print(f"{name:<{width}}  {asks:<24}  {pin:<12}  {'yes' if fits else 'NO'}")
    clashes = [name for name, *_, fits in rows if not fits]
    print(f"ColossalAI {args.version} " + (f"cannot share this environment: {', '.join(clashes)} conflict."
                                            if clashes else "can share this environment."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
