"""An in-tree PEP 517 build backend for the flywheel package, with no build dependencies.

The package is pure Python, so a wheel is a zip of ``flywheel/*.py`` plus the three
``.dist-info`` files (METADATA, WHEEL, RECORD, per the wheel spec, PEP 427). Needing no
setuptools or wheel means ``pip install ./python`` works offline in any environment,
build isolation included (the isolated environment needs nothing installed).
Hooks: build_wheel, build_editable (PEP 660: a ``.pth`` pointing at this source tree),
build_sdist, and the optional get_requires_* hooks (nothing is required).
"""

import base64
import hashlib
import io
import os
import re
import tarfile
import time
import zipfile

NAME = "flywheel"
SUMMARY = ("Client of the flywheel publisher's push API: push checkpoints, "
           "wait until the fleet serves them")
REQUIRES_PYTHON = ">=3.8"
EXTRAS = {"torch": ["torch"], "test": ["pytest"]}

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGE_DIR = os.path.join(_ROOT, NAME)


def _version():
    with open(os.path.join(_PACKAGE_DIR, "_version.py"), encoding="utf-8") as source:
        match = re.search(r'^__version__ = "([^"]+)"$', source.read(), re.M)
    if not match:
        raise RuntimeError("flywheel/_version.py has no __version__ = \"...\" line")
    return match.group(1)


def _metadata():
    lines = ["Metadata-Version: 2.1", f"Name: {NAME}", f"Version: {_version()}",
             f"Summary: {SUMMARY}", f"Requires-Python: {REQUIRES_PYTHON}"]
    for extra, requirements in EXTRAS.items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {r}; extra == "{extra}"' for r in requirements]
    lines.append("Description-Content-Type: text/markdown")
    with open(os.path.join(_ROOT, "README.md"), encoding="utf-8") as readme:
        return "\n".join(lines) + "\n\n" + readme.read()


def _package_files():
    """(archive name, absolute path) of every module of the package, sorted."""
    found = []
    for directory, subdirectories, names in os.walk(_PACKAGE_DIR):
        subdirectories[:] = sorted(d for d in subdirectories if d != "__pycache__")
        for name in sorted(names):
            if name.endswith(".py") or name == "py.typed":
                path = os.path.join(directory, name)
                found.append((os.path.relpath(path, _ROOT).replace(os.sep, "/"), path))
    return found


def _write_wheel(wheel_directory, entries):
    """Writes a wheel holding ``entries`` ((archive name, bytes)) plus its dist-info."""
    version = _version()
    dist_info = f"{NAME}-{version}.dist-info"
    entries = list(entries) + [
        (f"{dist_info}/METADATA", _metadata().encode("utf-8")),
        (f"{dist_info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: flywheel_build\n"
                               b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
    ]
    record = []
    for name, data in entries:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    entries.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode("utf-8")))
    basename = f"{NAME}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, basename), "w",
                         zipfile.ZIP_DEFLATED) as wheel:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, data)
    return basename


def _read(path):
    with open(path, "rb") as source:
        return source.read()


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, [(name, _read(path)) for name, path in _package_files()])


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, [(f"{NAME}.pth", (_ROOT + "\n").encode("utf-8"))])


def build_sdist(sdist_directory, config_settings=None):
    base = f"{NAME}-{_version()}"
    members = [("pyproject.toml", os.path.join(_ROOT, "pyproject.toml")),
               ("README.md", os.path.join(_ROOT, "README.md")),
               ("_build/flywheel_build.py", os.path.abspath(__file__))] + _package_files()
    members.append(("PKG-INFO", None))
    basename = f"{base}.tar.gz"
    with tarfile.open(os.path.join(sdist_directory, basename), "w:gz",
                      format=tarfile.PAX_FORMAT) as sdist:
        for name, path in members:
            data = _metadata().encode("utf-8") if path is None else _read(path)
            info = tarfile.TarInfo(f"{base}/{name}")
            info.size = len(data)
            info.mtime = int(time.time())
            info.mode = 0o644
            sdist.addfile(info, io.BytesIO(data))
    return basename
