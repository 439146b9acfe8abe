"""The copy weft install writes to the host: which OCI hook its bin/weft-oci-hook runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hooks import native
from shim.install import bundle


def _hook_files(tmp_path: Path) -> list[tuple[Path, str]]:
    py = tmp_path / "weft_oci_hook.py"
    py.write_text("# the Python hook\n")
    return [(py, f"{bundle.APP}/hooks/weft_oci_hook.py")]


def test_the_native_hook_is_bin_weft_oci_hook_where_weft_carries_one(tmp_path: Path) -> None:
    try:
        built = native.build()
    except native.NativeHookUnavailable as exc:
        pytest.fail(f"the native hook could not be built here (scripts/setup.sh installs gcc): {exc}")
    dest = tmp_path / "opt"
    bundle.build([*_hook_files(tmp_path), (built, bundle.NATIVE_HOOK)], dest, "stamp", launchers=True)
    hook = dest / "bin" / "weft-oci-hook"
    assert hook.read_bytes() == built.read_bytes() and os.access(hook, os.X_OK)
    # Static: it runs with nothing of the copy on the loader's path, and takes its fast path.
    res = subprocess.run([str(hook), "createRuntime"], input='{"annotations": {}}', capture_output=True, text=True,
                         env={})
    assert (res.returncode, res.stderr) == (0, "")


def test_without_the_native_hook_the_launcher_runs_the_python_one(tmp_path: Path) -> None:
    dest = tmp_path / "opt"
    bundle.build(_hook_files(tmp_path), dest, "stamp", launchers=True)
    hook = dest / "bin" / "weft-oci-hook"
    assert hook.read_text() == bundle.HOOK_SH and os.access(hook, os.X_OK)
    assert "-S -I" in bundle.HOOK_SH and "hooks/weft_oci_hook.py" in bundle.HOOK_SH
