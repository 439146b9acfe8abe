"""containerd's configuration: recognise it, and plan the ``weft`` runtime handler drop-in (pure).

The drop-in is imported last, by an explicit path appended to the main file's
``imports`` (its one change there), on every containerd version: that works
whether or not the host's file carries containerd 2.2+'s default
``/etc/containerd/conf.d/*.toml`` glob, keeps weft's files in its own
directory, and puts the drop-in after every other import, so its table wins
whatever the other drop-ins are named. How an import is merged decides what the
drop-in holds, and that depends on the containerd running, not on the file:

- **containerd 1.6 and 1.7** load the main file, then each import in order,
  and an import's ``[plugins]`` entry *replaces the whole plugin section*
  (``mergeConfig`` in ``services/server/config``: "maps merged by keys, but
  values are replaced entirely"). A drop-in holding only the ``weft`` runtime
  would wipe the host's sandbox image, CNI directories and runc options, so
  the drop-in carries the host's *effective* CRI section (the main file's, as
  replaced by its imports) plus the ``weft`` runtime. A re-install (the
  DaemonSet runs it on every start) recomputes it from the backed-up
  originals, so later edits of the host's CRI section are picked up.
- **containerd 2.x** migrates each file on its own to its current config
  version (2 -> 3 splits the CRI plugin: ``io.containerd.cri.v1.runtime`` holds
  ``containerd.runtimes``, ``io.containerd.cri.v1.images`` the image settings,
  ``io.containerd.grpc.v1.cri`` keeps the streaming server; 3 -> 4, in 2.3,
  moves the server addresses into ``io.containerd.server.v1.*`` plugins), then
  merges it *deeply* (``mergo`` with override: tables key by key, scalars and
  arrays replaced). So the drop-in holds only the ``weft`` runtime and leaves
  the host's settings to the host's files (a full copy would be harmless
  once, but would freeze them as of the install). It has the main file's
  version: recent releases skip an import whose version is higher than the
  main file's (containerd's check on drop-in versions, 2026).

The ``weft`` runtime is the default runtime as containerd sees it (runc v2,
with its options, so the cgroup driver matches) plus a ``base_runtime_spec``
that adds the OCI hook and ``weft.io/*`` annotation pass-through (containerd
puts annotations in the OCI spec, where the hook reads them, only for a
handler that lists them).

Recognised: config version 2 (containerd 1.5-1.7 and 2.x), 3 (2.x) and 4
(2.3 and later), on a containerd weft is tested with (:data:`TESTED`).
Refused, with the file named: unparseable TOML, version 1 or above 4, a
version the running containerd does not read, a disabled CRI plugin, a
default runtime that is not runc v2, a ``weft`` runtime that is not ours,
nested imports, an untested containerd.
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

from shim.errors import UnrecognisedHost, UntestedContainerd
from shim.hookspec import with_hooks
from shim.install import tomlw
from shim.install.default_spec import SPEC as DEFAULT_SPEC

CONFIG = "/etc/containerd/config.toml"
DROPIN = "/etc/containerd/weft/runtime.toml"
BASE_SPEC = "/etc/containerd/weft/base-spec.json"
CRI = "io.containerd.grpc.v1.cri"  # version 2: the whole CRI plugin; 3 and later: its streaming server only
CRI_RUNTIME = "io.containerd.cri.v1.runtime"  # version 3 and later: containerd.runtimes and the default runtime
CRI_IMAGES = "io.containerd.cri.v1.images"
GRPC_SERVER = "io.containerd.server.v1.grpc"  # version 4: the socket's address
DEFAULT_SOCKET = "/run/containerd/containerd.sock"
HANDLER = "weft"
ANNOTATIONS = ["weft.io/*"]
RUNC_V2 = "io.containerd.runc.v2"
# Where a host's containerd binary is, for its --version when nothing answers on its socket.
BINARIES = ("/usr/bin/containerd", "/usr/local/bin/containerd", "/usr/sbin/containerd", "/bin/containerd")
# The containerd lines the tests run against (docs/operations.md#containerd-versions names the releases):
# Debian 12's 1.6, 1.7 and 2.x built from Go modules. Any other line is refused.
TESTED = ((1, 6), (1, 7), (2, None))
# containerd 2.x's own ``runc`` (``DefaultRuntimeConfig`` in ``internal/cri/config``, 2.4.2): the files' runc
# tables are decoded onto it, so keys they leave out keep these values.
RUNC_DEFAULTS_2X: dict[str, Any] = {
    "runtime_type": RUNC_V2, "sandboxer": "podsandbox",
    "options": {"NoNewKeyring": False, "ShimCgroup": "", "IoUid": 0, "IoGid": 0, "BinaryName": "", "Root": "",
                "SystemdCgroup": False, "CriuImagePath": "", "CriuWorkPath": ""}}
# The oldest containerd that reads each config version (2.0 added version 3, 2.3 version 4).
_CONFIG_VERSIONS = {2: (1, 0), 3: (2, 0), 4: (2, 3)}
_BANNER_1X = (
    "Written by `weft install`; `weft uninstall` removes it. Do not edit: it is regenerated.\n"
    "containerd 1.x replaces a whole plugin section with an import's, so this holds the host's\n"
    f"effective CRI section (from {CONFIG} and its imports) plus the '{HANDLER}' runtime handler."
)
_BANNER_2X = (
    "Written by `weft install`; `weft uninstall` removes it. Do not edit: it is regenerated.\n"
    "containerd 2.x merges imports into the host's configuration table by table, so this holds\n"
    f"only the '{HANDLER}' runtime handler: the host's default runtime (from {CONFIG}\n"
    "and its imports) with weft's base spec and annotations."
)


class HostFiles(Protocol):
    """Read-only view of the host's files, by host path (``/etc/...``), whatever the install root."""

    def read(self, path: str) -> bytes | None: ...

    def glob(self, pattern: str) -> list[str]: ...


@dataclass(frozen=True)
class Containerd:
    """The containerd the configuration is for, and where that was learnt (a socket or a binary)."""

    version: str  # as containerd says it: "1.6.20~ds1", "v2.4.2"
    major: int
    minor: int
    source: str

    @classmethod
    def parse(cls, text: str, source: str) -> Containerd:
        m = re.search(r"(?<![\w.])v?(\d+)\.(\d+)\.\d+\S*", text)
        if m is None:
            raise UnrecognisedHost(f"{source}: {text.strip()!r} is not a containerd version; nothing was changed")
        return cls(m.group(0), int(m.group(1)), int(m.group(2)), source)

    @property
    def tested(self) -> bool:
        return any(self.major == major and minor in (None, self.minor) for major, minor in TESTED)

    @property
    def merges_deeply(self) -> bool:
        return self.major >= 2

    def reads(self, config_version: int) -> bool:
        return (self.major, self.minor) >= _CONFIG_VERSIONS[config_version]


def check_tested(ctrd: Containerd) -> None:
    if not ctrd.tested:
        lines = ", ".join(f"{a}.{b}" if b is not None else f"{a}.x" for a, b in TESTED)
        raise UntestedContainerd(
            f"{ctrd.source}: containerd {ctrd.version} is not a version weft is tested with ({lines} are; "
            "docs/operations.md#containerd-versions); nothing was changed")


@dataclass(frozen=True)
class ContainerdPlan:
    config: bytes  # the main config with the drop-in imported (unchanged if it already is)
    dropin: bytes
    base_spec: bytes
    socket: str  # containerd's CRI socket (host path), for the agent
    # Where the CRI plugin reads CDI specs when the host sets it (None: containerd's default, /etc/cdi and
    # /var/run/cdi), for the agent: a DRA claim's GPUs are named in those specs.
    cdi_spec_dirs: tuple[str, ...] | None = None
    # The image containerd runs each pod's sandbox from, when its configuration names one: what the agent's
    # reservation pods run, so that they need no image the node would not otherwise have.
    sandbox_image: str | None = None
    # The default runtime, as containerd merges the files: its name and its table (the weft handler's model).
    default_runtime: str = "runc"
    runtimes: dict[str, Any] | None = None


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


def _version(path: str, doc: dict[str, Any]) -> int:
    """The main file's config version: 2, 3 or 4."""
    version = doc.get("version", 1)
    if version in _CONFIG_VERSIONS:
        return version
    raise _refuse(path, f"config version {version!r} is not understood (weft reads versions 2, 3 and 4; "
                        "run `containerd config migrate` first)")


def imported_files(files: HostFiles, path: str, doc: dict[str, Any]) -> list[str]:
    """The files ``path``'s ``imports`` name, patterns expanded, in containerd's order; weft's drop-in left out, and
    each file once: containerd loads a file once, and ``containerd config dump`` lists the main file among its
    imports (a config.toml written from a dump, as NVIDIA's toolkit can, names itself)."""
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
            found = sorted(files.glob(full))
        else:
            found = [full]
        out += [f for f in found if f != path and f not in out]
    return out


def socket_address(doc: dict[str, Any]) -> str:
    """containerd's gRPC socket (host path) from the main file: ``[grpc]`` up to version 3, a plugin in 4."""
    if doc.get("version") == 4:
        address = doc.get("plugins", {}).get(GRPC_SERVER, {}).get("address", DEFAULT_SOCKET)
    else:
        address = doc.get("grpc", {}).get("address", DEFAULT_SOCKET)
    if not isinstance(address, str) or not address:
        raise _refuse(CONFIG, "containerd's gRPC address is not a path")
    return address.removeprefix("unix://")


def socket(files: HostFiles) -> str:
    """Where containerd listens, read before anything else (to ask it its version); refusals as :func:`plan`'s."""
    _, doc = _load(files, CONFIG)
    _version(CONFIG, doc)
    return socket_address(doc)


def _documents(files: HostFiles, doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The main file and its imports, in the order containerd loads them."""
    docs = [(CONFIG, doc)]
    for imp in imported_files(files, CONFIG, doc):
        _, idoc = _load(files, imp)
        if idoc.get("imports"):
            raise _refuse(imp, "an imported file with its own `imports` is not supported")
        docs.append((imp, idoc))
    for path, d in docs:
        disabled = d.get("disabled_plugins", [])
        if isinstance(disabled, list) and {CRI, CRI_RUNTIME, CRI_IMAGES, "cri"} & set(disabled):
            raise _refuse(path, "the CRI plugin is disabled (disabled_plugins); kubelet cannot be using this "
                                "containerd")
    return docs


# -- containerd 1.x: an import's plugin section replaces the one before --------------------------------------------
def _effective_cri_1x(docs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    cri = docs[0][1].get("plugins", {}).get(CRI, {})
    for imp, idoc in docs[1:]:
        section = idoc.get("plugins", {}).get(CRI)
        if section is not None:
            if idoc.get("version", 1) != 2:
                raise _refuse(imp, f"config version {idoc.get('version', 1)!r} is not containerd 1.x's 2")
            cri = section
    if not isinstance(cri, dict):
        raise _refuse(CONFIG, f"plugins.{CRI!r} is not a table")
    return copy.deepcopy(cri)


# -- containerd 2.x: each file migrated on its own, then merged table by table -------------------------------------
def _runtime_section(path: str, doc: dict[str, Any]) -> dict[str, Any]:
    """This file's ``io.containerd.cri.v1.runtime`` section as containerd 2.x sees it after migrating the file.

    Versions 1 and 2 keep runtimes in ``io.containerd.grpc.v1.cri`` (``cri`` in version 1); 2.x's migration
    (``configMigration`` in ``plugins/cri/runtime``) copies its ``containerd`` table over, key by key where
    the runtime section lacks one, without the image service's keys, and renames ``sandbox_mode``. Only that
    table is read here: it holds the default runtime the ``weft`` handler copies.
    """
    plugins = doc.get("plugins", {})
    if not isinstance(plugins, dict):
        raise _refuse(path, "`plugins` is not a table")
    dst = copy.deepcopy(plugins.get(CRI_RUNTIME, {}))
    if not isinstance(dst, dict):
        raise _refuse(path, f"plugins.{CRI_RUNTIME!r} is not a table")
    if doc.get("version", 1) >= 3:
        return dst
    src = plugins.get(CRI, plugins.get("cri") if doc.get("version", 1) < 2 else None)
    if src is None:
        return dst
    if not isinstance(src, dict) or not isinstance(src.get("containerd", {}), dict):
        raise _refuse(path, f"plugins.{CRI!r} is not a table")
    if "cdi_spec_dirs" in src and "cdi_spec_dirs" not in dst:  # migrated like every other runtime key
        dst["cdi_spec_dirs"] = copy.deepcopy(src["cdi_spec_dirs"])
    ctr = dst.setdefault("containerd", {})
    for k, v in src.get("containerd", {}).items():
        if k not in ("snapshotter", "disable_snapshot_annotations", "discard_unpacked_layers") and k not in ctr:
            ctr[k] = copy.deepcopy(v)
    for rt in ctr.get("runtimes", {}).values() if isinstance(ctr.get("runtimes"), dict) else ():
        if isinstance(rt, dict) and "sandbox_mode" in rt and "sandboxer" not in rt:
            rt["sandboxer"] = rt.pop("sandbox_mode")
    return dst


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    """containerd 2.x's merge of one file into the ones before: tables key by key, anything else replaced."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)


def _effective_runtime_2x(docs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"containerd": {"default_runtime_name": "runc",
                                          "runtimes": {"runc": copy.deepcopy(RUNC_DEFAULTS_2X)}}}
    for path, d in docs:
        _merge(out, _runtime_section(path, d))
    return out


# containerd 2.x's own sandbox image where no file names one (its internal/cri/config DefaultSandboxImage), from
# the first release line that has it; 2.x's verbose CRI Status no longer carries the image configuration.
DEFAULT_SANDBOX_IMAGES_2X = (((2, 0), "registry.k8s.io/pause:3.10"), ((2, 2), "registry.k8s.io/pause:3.10.1"),
                             ((2, 3), "registry.k8s.io/pause:3.10.2"))


def running_sandbox_image(files: HostFiles, ctrd: Containerd) -> str | None:
    """The pause image ``ctrd`` runs sandboxes from as its files say, or on 2.x its own default where none names
    one (None: a 1.x whose files name none, whose Status says it). Raises :class:`UnrecognisedHost` naming an
    unreadable file."""
    docs = documents(files)
    if not ctrd.merges_deeply:
        pause = _effective_cri_1x(docs).get("sandbox_image")
        return pause if isinstance(pause, str) and pause else None
    found = sandbox_image_2x(docs)
    if found:
        return found
    return [image for since, image in DEFAULT_SANDBOX_IMAGES_2X if (ctrd.major, ctrd.minor) >= since][-1]


def sandbox_image_2x(docs: list[tuple[str, dict[str, Any]]]) -> str | None:
    """The pause image containerd 2.x runs pods' sandboxes from, as the last file that names it says
    (``pinned_images.sandbox`` of the image service; a version 2 file's ``sandbox_image``, which 2.x migrates
    there); None where no file does."""
    found = None
    for _, d in docs:
        plugins = d.get("plugins", {})
        if not isinstance(plugins, dict):
            continue
        if d.get("version", 1) >= 3:
            images = plugins.get(CRI_IMAGES, {})
            pinned = images.get("pinned_images", {}) if isinstance(images, dict) else {}
            value = pinned.get("sandbox") if isinstance(pinned, dict) else None
        else:
            cri = plugins.get(CRI, plugins.get("cri", {}))
            value = cri.get("sandbox_image") if isinstance(cri, dict) else None
        if isinstance(value, str) and value:
            found = value
    return found


# -- the weft runtime ----------------------------------------------------------------------------------------------
def _weft_runtime(files: HostFiles, section: dict[str, Any], hook_argv: list[str], broker_socket: str) -> tuple[
        dict[str, Any], dict[str, Any]]:
    """(the ``weft`` runtime, its base spec) from a CRI (1.x) or CRI runtime (2.x) section's ``containerd`` table."""
    ctr = section.get("containerd", {})
    if not isinstance(ctr, dict):
        raise _refuse(CONFIG, "the CRI plugin's `containerd` is not a table")
    default = ctr.get("default_runtime_name", "runc")
    runtimes = ctr.get("runtimes", {})
    if not isinstance(runtimes, dict):
        raise _refuse(CONFIG, "containerd.runtimes is not a table")
    existing = runtimes.get(HANDLER)
    if existing is not None and (not isinstance(existing, dict) or existing.get("base_runtime_spec") != BASE_SPEC):
        raise _refuse(CONFIG, f"a runtime handler named {HANDLER!r} already exists and is not weft's")
    base = runtimes.get(default, {"runtime_type": RUNC_V2})
    if not isinstance(base, dict):
        raise _refuse(CONFIG, f"the default runtime {default!r} is not a table")
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
    return weft, with_hooks(spec, hook_argv, broker_socket)


def _top_level_span(text: str) -> int:
    """Offset of the first table header: top-level keys must come before it."""
    m = re.search(r"^[ \t]*\[", text, re.MULTILINE)
    return m.start() if m else len(text)


def _array(text: str, start: int) -> tuple[int, list[tuple[int, int]]]:
    """The array that opens at ``text[start] == '['`` (flat, of strings): the offset just past its ``]`` and the
    span of each string in it; (-1, []) where it does not close."""
    depth, i, quote, spans, began = 0, start, "", [], 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = ""
                spans.append((began, i + 1))
        elif c in "\"'":
            quote, began = c, i
        elif c == "#":
            i = text.find("\n", i)
            if i < 0:
                break
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth == 0:
                return i + 1, spans
        i += 1
    return -1, []


def _imports_line(text: str) -> re.Match[str] | None:
    return re.compile(r"^imports[ \t]*=[ \t]*", re.MULTILINE).search(text, 0, _top_level_span(text))


def _literal(text: str, span: tuple[int, int]) -> str:
    return tomllib.loads(f"x = {text[span[0]:span[1]]}")["x"]


def _checked(new: str, want: dict[str, Any], path: str, what: str) -> str:
    return _reads_as(new, want, path, f"cannot {what} without rewriting the file (write `imports` as a plain list "
                                      "before the first table)")


def _reads_as(new: str, want: dict[str, Any], path: str, refusal: str) -> str:
    """``new``, the file edited line by line, if it reads as ``want`` (the edit meant); refused with ``refusal``
    if it does not, so an edit that would change more than it should never reaches the file."""
    try:
        ok = tomllib.loads(new) == want
    except tomllib.TOMLDecodeError:
        ok = False
    if not ok:
        raise _refuse(path, refusal)
    return new


def with_import(text: str, doc: dict[str, Any], entry: str, path: str = CONFIG) -> str:
    """``text`` with ``entry`` last in its ``imports``: the smallest edit (the entry added after the list's last, or
    a line of its own where the file has no ``imports``), checked by reading it back. An entry already there but
    not last is moved last: behind it, on containerd 1.x, another file's CRI section would replace weft's."""
    imports = doc.get("imports", [])
    if imports and imports[-1] == entry:
        return text
    if entry in imports:
        text = without_import(text, entry, path)
        doc = tomllib.loads(text)
    wanted = [*[e for e in doc.get("imports", []) if e != entry], entry]
    m = _imports_line(text)
    if m:
        end, spans = _array(text, m.end()) if text[m.end():m.end() + 1] == "[" else (-1, [])
        if end < 0:
            return _checked(text, {**doc, "imports": wanted}, path, "add weft's drop-in to `imports`")
        at = spans[-1][1] if spans else m.end() + 1
        new = text[:at] + (", " if spans else "") + json.dumps(entry) + text[at:]
    else:
        head = _top_level_span(text)
        v = re.compile(r"^version[ \t]*=[ \t]*\d+[ \t]*(#.*)?(\n|$)", re.MULTILINE).search(text, 0, head)
        at = v.end() if v else 0
        sep = "" if at == 0 or text[at - 1] == "\n" else "\n"
        new = text[:at] + sep + f"imports = {json.dumps(wanted)}" + _ADDED + "\n" + text[at:]
    return _checked(new, {**doc, "imports": wanted}, path, "add weft's drop-in to `imports`")


_ADDED = "  # added by weft install"


def without_import(text: str, entry: str = DROPIN, path: str = CONFIG) -> str:
    """``text`` with ``entry`` taken out of its ``imports`` and nothing else changed: the exact inverse of
    :func:`with_import` (the line it added goes whole; an entry it added to a list goes with its separator), so
    that a file someone else has changed since keeps their change. Refused, with the file named, where that
    cannot be done by editing the one list."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _refuse(path, f"not valid TOML ({exc})") from exc
    imports = doc.get("imports", [])
    if not isinstance(imports, list) or entry not in imports:
        return text
    rest = [e for e in imports if e != entry]
    want = {**doc, "imports": rest}
    m = _imports_line(text)
    end, spans = _array(text, m.end()) if m and text[m.end():m.end() + 1] == "[" else (-1, [])
    ours = [s for s in spans if _literal(text, s) == entry]
    if m is None or end < 0 or not ours:
        raise _refuse(path, f"cannot take {entry} out of `imports` without rewriting the file")
    line_end = text.find("\n", end)
    line_end = len(text) if line_end < 0 else line_end + 1
    if not rest and text[end:line_end].rstrip("\n") == _ADDED:
        new = text[:m.start()] + text[line_end:]
        want = {k: v for k, v in doc.items() if k != "imports"}
        return _checked(new, want, path, f"take {entry} out of `imports`")
    new = text
    for a, b in reversed(ours):
        before = re.search(r",[ \t]*$", new[:a])
        if before:  # `"x", "ours"`: the separator before it goes with it
            a = before.start()
        else:
            after = re.match(r"[ \t]*,[ \t]*", new[b:])
            b += after.end() if after else 0
        new = new[:a] + new[b:]
    return _checked(new, want, path, f"take {entry} out of `imports`")


_HEADER = re.compile(r"^[ \t]*\[(?!\[)([^\]\n]+)\][ \t]*(#[^\n]*)?$")


def _header_path(inner: str) -> tuple[str, ...] | None:
    """The key path of a table header's ``inner`` text (``plugins."io.containerd.grpc.v1.cri".containerd``)."""
    try:
        node: Any = tomllib.loads(f"[{inner}]\n")
    except tomllib.TOMLDecodeError:
        return None
    path: list[str] = []
    while isinstance(node, dict) and len(node) == 1:
        key = next(iter(node))
        path.append(key)
        node = node[key]
    return tuple(path)


def weft_runtime_copies(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    """Where a file holds a copy of weft's runtime handler (a ``runtimes.weft`` table naming weft's base spec): put
    there by another tool that copied containerd's whole configuration (NVIDIA's toolkit from ``containerd config
    dump``, or its v1.20 drop-in with the whole CRI section)."""
    found = []
    plugins = doc.get("plugins", {})
    for plugin in (CRI, CRI_RUNTIME, "cri"):
        section = plugins.get(plugin) if isinstance(plugins, dict) else None
        ctr = section.get("containerd") if isinstance(section, dict) else None
        runtimes = ctr.get("runtimes") if isinstance(ctr, dict) else None
        rt = runtimes.get(HANDLER) if isinstance(runtimes, dict) else None
        if isinstance(rt, dict) and rt.get("base_runtime_spec") == BASE_SPEC:
            found.append(("plugins", plugin, "containerd", "runtimes", HANDLER))
    return found


def without_weft_runtime(text: str, path: str) -> str:
    """``text`` without the copies of weft's runtime handler another tool took into it (each its table and
    sub-tables, line by line), nothing else changed: after weft is gone, containerd would refuse to start its CRI
    plugin on a handler whose base spec file is no longer there. Refused, naming the file, where a copy is not
    written as tables of its own."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _refuse(path, f"not valid TOML ({exc})") from exc
    targets = weft_runtime_copies(doc)
    if not targets:
        return text
    out, dropping = [], False
    for line in text.splitlines(keepends=True):
        m = _HEADER.match(line.rstrip("\n"))
        if m:
            key = _header_path(m.group(1))
            dropping = key is not None and any(key[:len(t)] == t for t in targets)
        if not dropping:
            out.append(line)
    new = "".join(out)
    want = copy.deepcopy(doc)
    for t in targets:
        del want["plugins"][t[1]]["containerd"]["runtimes"][HANDLER]
    return _reads_as(new, want, path, f"holds a copy of weft's '{HANDLER}' runtime handler that cannot be taken "
                                      "out by removing its tables (remove it by hand: containerd will not start its "
                                      f"CRI plugin on it once {BASE_SPEC} is gone)")


def plan(files: HostFiles, hook_argv: list[str], broker_socket: str, ctrd: Containerd) -> ContainerdPlan:
    check_tested(ctrd)
    text, doc = _load(files, CONFIG)
    version = _version(CONFIG, doc)
    if not ctrd.reads(version):
        raise _refuse(CONFIG, f"config version {version} is not read by containerd {ctrd.version} "
                              f"({ctrd.source}), which would not start on it")
    docs = _documents(files, doc)
    default, runtimes = effective_runtimes(docs, ctrd)
    if ctrd.merges_deeply:
        runtime = _effective_runtime_2x(docs)
        cdi_dirs = _cdi_spec_dirs(runtime)
        weft, spec = _weft_runtime(files, runtime, hook_argv, broker_socket)
        section = {CRI if version == 2 else CRI_RUNTIME: {"containerd": {"runtimes": {HANDLER: weft}}}}
        dropin, banner = {"version": version, "plugins": section}, _BANNER_2X
        pause = sandbox_image_2x(docs)
    else:
        cri = _effective_cri_1x(docs)
        cdi_dirs = _cdi_spec_dirs(cri)
        pause = cri.get("sandbox_image") if isinstance(cri.get("sandbox_image"), str) else None
        weft, spec = _weft_runtime(files, cri, hook_argv, broker_socket)  # checks the tables it reads
        ctr = cri.setdefault("containerd", {})
        # The default runtime is written out too when the host leaves it implicit, as weft always did on 1.x.
        ctr.setdefault("runtimes", {}).setdefault(ctr.get("default_runtime_name", "runc"), {"runtime_type": RUNC_V2})
        ctr["runtimes"][HANDLER] = weft
        dropin, banner = {"version": 2, "plugins": {CRI: cri}}, _BANNER_1X
    try:
        dropin_text = tomlw.dumps(dropin, banner=banner)
    except tomlw.TomlWriteError as exc:
        raise _refuse(CONFIG, f"the CRI section holds a value weft cannot write back ({exc})") from exc
    return ContainerdPlan(
        config=with_import(text, doc, DROPIN).encode(),
        dropin=dropin_text.encode(),
        base_spec=(json.dumps(spec, indent=2) + "\n").encode(),
        socket=socket_address(doc),
        cdi_spec_dirs=cdi_dirs,
        sandbox_image=pause or None,
        default_runtime=default,
        runtimes=runtimes,
    )


def effective_runtimes(docs: list[tuple[str, dict[str, Any]]], ctrd: Containerd) -> tuple[str, dict[str, Any]]:
    """(the default runtime's name, every runtime handler) as ``ctrd`` merges the files (weft's drop-in left out)."""
    section = _effective_runtime_2x(docs) if ctrd.merges_deeply else _effective_cri_1x(docs)
    ctr = section.get("containerd", {}) if isinstance(section.get("containerd", {}), dict) else {}
    runtimes = ctr.get("runtimes", {}) if isinstance(ctr.get("runtimes", {}), dict) else {}
    return str(ctr.get("default_runtime_name", "runc")), copy.deepcopy(runtimes)


def documents(files: HostFiles) -> list[tuple[str, dict[str, Any]]]:
    """config.toml and its imports (weft's drop-in left out), read; refusals as :func:`plan`'s."""
    _, doc = _load(files, CONFIG)
    _version(CONFIG, doc)
    return _documents(files, doc)


def binary_of(runtime: dict[str, Any]) -> str:
    """The program a runc-v2 runtime handler runs (``options.BinaryName``; "" for runc on PATH)."""
    options = runtime.get("options", {}) if isinstance(runtime, dict) else {}
    name = options.get("BinaryName", "") if isinstance(options, dict) else ""
    return name if isinstance(name, str) else ""


def _cdi_spec_dirs(section: dict[str, Any]) -> tuple[str, ...] | None:
    """The CRI runtime section's ``cdi_spec_dirs``, if the host sets it; refused if the agent could not be told it."""
    dirs = section.get("cdi_spec_dirs")
    if dirs is None:
        return None
    if not isinstance(dirs, list) or not all(isinstance(d, str) and d.startswith("/") and not re.search(r"[:\s]", d)
                                             for d in dirs):
        raise _refuse(CONFIG, f"cdi_spec_dirs {dirs!r} is not a list of absolute paths weft can pass on "
                              "(no ':' or white space)")
    return tuple(dirs)
