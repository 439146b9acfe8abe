"""The node's CDI specs, read for the GPUs their devices name (``shim.core.cdi`` parses them).

A DRA driver writes a claim's spec when kubelet prepares the claim, just before the pod's
containers are created, and removes it when the claim is unprepared; so the directories are read
when a container of an opted-in pod has CDI devices that do not name a GPU themselves, each file
parsed again only when it changed. The directories are the ones containerd reads
(``cdi_spec_dirs``, by default ``/etc/cdi`` and ``/var/run/cdi``); a file that cannot be read or
parsed is skipped, as the runtime would skip it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from shim import log
from shim.core.cdi import spec_gpus

_log = log.get("weft.cri")
_SUFFIXES = (".json", ".yaml", ".yml")


class CdiSpecs:
    def __init__(self, dirs: Sequence[Path]) -> None:
        self.dirs = list(dirs)
        self._parsed: dict[Path, tuple[tuple[int, int], dict[str, frozenset[str]]]] = {}
        self._lock = threading.Lock()

    def gpus(self) -> dict[str, frozenset[str]]:
        """Qualified CDI device name -> the GPU UUIDs its edits name, over every spec (later dirs win, as in CDI)."""
        out: dict[str, frozenset[str]] = {}
        with self._lock:
            seen = set()
            for d in self.dirs:
                try:
                    files = sorted(p for p in d.iterdir() if p.suffix in _SUFFIXES)
                except OSError:
                    continue
                for path in files:
                    seen.add(path)
                    out.update(self._file(path))
            for gone in self._parsed.keys() - seen:
                del self._parsed[gone]
        return out

    def _file(self, path: Path) -> dict[str, frozenset[str]]:
        try:
            st = path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            cached = self._parsed.get(path)
            if cached is not None and cached[0] == stamp:
                return cached[1]
            text = path.read_text()
            spec: Any = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            _log.debug("cdi.spec_skipped", path=str(path), error=str(exc))
            return {}
        found = spec_gpus(spec) if isinstance(spec, dict) else {}
        self._parsed[path] = (stamp, found)
        return found
