"""containerd's configuration: recognise it, and plan the ``weft`` runtime handler drop-in (pure).

How containerd 1.6 reads ``imports`` decides what the drop-in must hold: it
loads the main file, then each import in order (globs expanded in lexical
order, relative paths against the importing file), and for each ``[plugins]``
entry an import defines it *replaces the whole plugin section* (``mergeConfig``
in ``services/server/config``: "maps merged by keys, but values are replaced
entirely"). A drop-in holding only ``...cri.containerd.runtimes.weft`` would
therefore wipe the host's sandbox image, CNI directories and runc options. So
the drop-in carries the host's *effective* CRI section (the main file's, as
replaced by its imports) plus the ``weft`` runtime, and is imported last by an
explicit path appended to ``imports``; the main file gains only that one line.
A re-install (the DaemonSet runs it on every start) recomputes it from the
backed-up originals, so later edits of the host's CRI section are picked up.

The ``weft`` runtime is the default runtime (runc v2, with its options, so the
cgroup driver matches) plus a ``base_runtime_spec`` that adds the OCI hook and
``weft.io/*`` annotation pass-through (containerd puts annotations in the OCI spec, where
the hook reads them, only for a handler that lists them).

Recognised: config version 2 (containerd 1.5-1.7, what kubeadm guides, EKS
and ``containerd config default`` write). Refused, with the file named:
unparseable TOML, version 1 or 3, a disabled CRI plugin, a default runtime
that is not runc v2, a ``weft`` runtime that is not ours, nested imports.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import posixpath
import re
import tomllib
from dataclasses import dataclass
from typing import Any, Protocol

from shim.errors import UnrecognisedHost
from shim.hookspec import with_hooks
from shim.install import tomlw
from shim.install.default_spec import SPEC as DEFAULT_SPEC

CONFIG = "/etc/containerd/config.toml"
DROPIN = "/etc/containerd/weft/runtime.toml"
BASE_SPEC = "/etc/containerd/weft/base-spec.json"
CRI = "io.containerd.grpc.v1.cri"
DEFAULT_SOCKET = "/run/containerd/containerd.sock"
HANDLER = "weft"
ANNOTATIONS = ["weft.io/*"]
RUNC_V2 = "io.containerd.runc.v2"
BANNER = (
    "Written by `weft install`; `weft uninstall` removes it. Do not edit: it is regenerated.\n"
    "containerd 1.6 replaces a whole plugin section with an import's, so this holds the host's\n"
    f"effective CRI section (from {CONFIG} and its imports) plus the '{HANDLER}' runtime handler."
)


class HostFiles(Protocol):
    """Read-only view of the host's files, by host path (``/etc/...``), whatever the install root."""

    def read(self, path: str) -> bytes | None: ...

    def glob(self, pattern: str) -> list[str]: ...


@dataclass(frozen=True)
class ContainerdPlan:
    config: bytes  # the main config with the drop-in imported (unchanged if it already is)
    dropin: bytes
    base_spec: bytes
    socket: str  # containerd's CRI socket (host path), for the agent


def _refuse(path: str, what: str) -> UnrecognisedHost:
    return UnrecognisedHost(f"{path}: {what}; nothing was changed")


def _load(files: HostFiles, path: str) -> tuple[str, dict[str, Any]]:
    raw = files.read(path)
    if raw is None:
        raise _refuse(path, "not found (weft installs onto containerd configured by this file)")
    try:
        text = raw.decode()
        return text, tomllib.loads(text)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise _refuse(path, f"not valid TOML ({exc})") from exc


def _check_version(path: str, doc: dict[str, Any]) -> None:
    version = doc.get("version", 1)
    if version == 2:
        return
    if version == 3:
        raise _refuse(path, "config version 3 (containerd 2.x) is not supported by this installer yet")
    raise _refuse(path, f"config version {version!r} is not understood (weft writes version 2; "
                        "run `containerd config migrate` first)")


def _imports(files: HostFiles, path: str, doc: dict[str, Any]) -> list[str]:
    entries = doc.get("imports", [])
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise _refuse(path, "`imports` is not a list of paths")
    out: list[str] = []
    for entry in entries:
        if entry == DROPIN:
            continue
        full = entry if posixpath.isabs(entry) else posixpath.join(posixpath.dirname(path), entry)
        if "*" in full:
            if fnmatch.fnmatch(DROPIN, full):
                raise _refuse(path, f"import pattern {entry!r} would also match weft's drop-in {DROPIN}")
            out += sorted(files.glob(full))
        else:
            out.append(full)
    return out


def effective_cri(files: HostFiles, path: str = CONFIG) -> tuple[str, dict[str, Any], dict[str, Any], list[str]]:
    """(main text, main doc, effective CRI section, imported files), as containerd 1.6 merges them."""
    text, doc = _load(files, path)
    _check_version(path, doc)
    disabled = doc.get("disabled_plugins", [])
    if isinstance(disabled, list) and (CRI in disabled or "cri" in disabled):
        raise _refuse(path, "the CRI plugin is disabled (disabled_plugins); kubelet cannot be using this containerd")
    cri = doc.get("plugins", {}).get(CRI, {})
    imported = _imports(files, path, doc)
    for imp in imported:
        _, idoc = _load(files, imp)
        if idoc.get("imports"):
            raise _refuse(imp, "an imported file with its own `imports` is not supported")
        section = idoc.get("plugins", {}).get(CRI)
        if section is not None:
            _check_version(imp, idoc)
            cri = section
    if not isinstance(cri, dict):
        raise _refuse(path, f"plugins.{CRI!r} is not a table")
    return text, doc, copy.deepcopy(cri), imported


def _weft_runtime(files: HostFiles, cri: dict[str, Any], hook_argv: list[str], broker_socket: str) -> tuple[
        dict[str, Any], dict[str, Any]]:
    ctr = cri.setdefault("containerd", {})
    default = ctr.get("default_runtime_name", "runc")
    runtimes = ctr.setdefault("runtimes", {})
    if not isinstance(runtimes, dict):
        raise _refuse(CONFIG, "containerd.runtimes is not a table")
    existing = runtimes.get(HANDLER)
    if existing is not None and existing.get("base_runtime_spec") != BASE_SPEC:
        raise _refuse(CONFIG, f"a runtime handler named {HANDLER!r} already exists and is not weft's")
    base = runtimes.setdefault(default, {"runtime_type": RUNC_V2})
    if base.get("runtime_type", RUNC_V2) != RUNC_V2:
        raise _refuse(CONFIG, f"the default runtime {default!r} is {base.get('runtime_type')!r}; "
                              f"weft's handler needs {RUNC_V2}")
    spec = DEFAULT_SPEC
    if base.get("base_runtime_spec"):
        spec_path = base["base_runtime_spec"]
        raw = files.read(spec_path)
        try:
            spec = json.loads(raw) if raw is not None else None
        except ValueError as exc:
            raise _refuse(spec_path, f"the default runtime's base_runtime_spec is not JSON ({exc})") from exc
        if not isinstance(spec, dict):
            raise _refuse(spec_path, "the default runtime's base_runtime_spec is missing or not a JSON object")
    weft = copy.deepcopy(base)
    weft["runtime_type"] = RUNC_V2
    weft["base_runtime_spec"] = BASE_SPEC
    for key in ("pod_annotations", "container_annotations"):
        weft[key] = [*[a for a in weft.get(key, []) if a not in ANNOTATIONS], *ANNOTATIONS]
    runtimes[HANDLER] = weft
    return cri, with_hooks(spec, hook_argv, broker_socket)


def _top_level_span(text: str) -> int:
    """Offset of the first table header: top-level keys must come before it."""
    m = re.search(r"^[ \t]*\[", text, re.MULTILINE)
    return m.start() if m else len(text)


def _array_end(text: str, start: int) -> int:
    """Offset just past the ``]`` closing the array that opens at ``text[start] == '['``."""
    depth, i, quote = 0, start, ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c == "#":
            i = text.find("\n", i)
            if i < 0:
                break
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def with_import(text: str, doc: dict[str, Any], entry: str, path: str = CONFIG) -> str:
    """``text`` with ``entry`` appended to its ``imports``: the smallest edit, checked by reading it back."""
    imports = [e for e in doc.get("imports", []) if e != DROPIN]
    if DROPIN in doc.get("imports", []) and doc["imports"][-1] == DROPIN:
        return text
    wanted = [*imports, entry]
    head = _top_level_span(text)
    m = re.compile(r"^imports[ \t]*=[ \t]*", re.MULTILINE).search(text, 0, head)
    line = f"imports = {json.dumps(wanted)}"
    if m:
        end = _array_end(text, m.end()) if text[m.end():m.end() + 1] == "[" else -1
        new = text if end < 0 else text[:m.start()] + line + text[end:]
    else:
        v = re.compile(r"^version[ \t]*=[ \t]*2[ \t]*(#.*)?(\n|$)", re.MULTILINE).search(text, 0, head)
        at = v.end() if v else 0
        sep = "" if at == 0 or text[at - 1] == "\n" else "\n"
        new = text[:at] + sep + line + "  # added by weft install\n" + text[at:]
    try:
        ok = tomllib.loads(new) == {**doc, "imports": wanted}
    except tomllib.TOMLDecodeError:
        ok = False
    if not ok:
        raise _refuse(path, "cannot add weft's drop-in to `imports` without rewriting the file "
                            "(write `imports` as a plain list before the first table)")
    return new


def plan(files: HostFiles, hook_argv: list[str], broker_socket: str) -> ContainerdPlan:
    text, doc, cri, _ = effective_cri(files)
    cri, spec = _weft_runtime(files, cri, hook_argv, broker_socket)
    try:
        dropin = tomlw.dumps({"version": 2, "plugins": {CRI: cri}}, banner=BANNER)
    except tomlw.TomlWriteError as exc:
        raise _refuse(CONFIG, f"the CRI section holds a value weft cannot write back ({exc})") from exc
    address = doc.get("grpc", {}).get("address", DEFAULT_SOCKET)
    if not isinstance(address, str) or not address:
        raise _refuse(CONFIG, "grpc.address is not a path")
    return ContainerdPlan(
        config=with_import(text, doc, DROPIN).encode(),
        dropin=dropin.encode(),
        base_spec=(json.dumps(spec, indent=2) + "\n").encode(),
        socket=address.removeprefix("unix://"),
    )
