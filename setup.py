"""Packaging hooks only; the metadata lives in setup.cfg.

Both wheels pip builds carry ``hf_zero_autoload.pth`` at their root, so that it lands in
site-packages and runs ``_hf_zero_autoload.start()`` at every interpreter start (a
cheap hook: see that module). ``build_py`` adds it to the regular wheel; the editable
wheel (``pip install -e .``, PEP 660) is written by setuptools from other parts, so the
file is added to it afterwards, with its line in RECORD so that uninstalling removes it.
"""

import base64
import hashlib
import os
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "hf_zero_autoload.pth"
# site runs a .pth line only if it starts with "import"; the module imports nothing heavy.
PTH_TEXT = "import _hf_zero_autoload; _hf_zero_autoload.start()\n"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:
            Path(self.build_lib, PTH_NAME).write_text(PTH_TEXT)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, os.path.join(self.build_lib, PTH_NAME)]


def _add_to_wheel(wheel: Path, name: str, text: str) -> None:
    """Rewrite ``wheel`` with the file ``name`` at its root, listed in its RECORD."""
    data = text.encode()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record_line = f"{name},sha256={digest},{len(data)}\n".encode()
    rewritten = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as dst:
        records = [i for i in src.infolist() if i.filename.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise RuntimeError(f"{wheel} has {len(records)} RECORD files, expected 1")
        dst.writestr(name, data)
        for item in src.infolist():
            payload = src.read(item)
            dst.writestr(item, record_line + payload if item in records else payload)
    os.replace(rewritten, wheel)


class EditableWheelWithPth(editable_wheel):
    def run(self):
        super().run()
        wheels = list(Path(self.dist_dir).glob("*.editable-*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one editable wheel in {self.dist_dir}, found {wheels}")
        _add_to_wheel(wheels[0], PTH_NAME, PTH_TEXT)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
