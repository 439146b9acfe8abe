"""kubelet's runtime endpoint: find where it is set and plan the switch to weft's agent (pure).

kubelet takes ``containerRuntimeEndpoint``/``imageServiceEndpoint`` from its
KubeletConfiguration (``/var/lib/kubelet/config.yaml``, what kubeadm writes
since 1.27) and from flags (``--container-runtime-endpoint``, in kubeadm's
``/var/lib/kubelet/kubeadm-flags.env`` before 1.27, or ``/etc/default/kubelet``);
a flag wins over the file. Every place that sets an endpoint is switched, so
the two never disagree; if none does, kubelet's default (containerd's socket)
is in force and the endpoint is added to config.yaml (or to the kubeadm flags
when there is no config.yaml).

YAML is read with PyYAML (already a dependency through lightkube) and *edited
as text*: one line per key is replaced or appended, and the result is read
back and must equal the original document with only those keys changed. This
keeps comments, order and quoting byte for byte (ruamel.yaml's round trip
would keep comments too, but re-flows other lines and is one more dependency),
and a file too unusual to edit that way (flow style, multi-line values) is
refused with its name instead of rewritten.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass
from typing import Any

import yaml

from shim.errors import UnrecognisedHost
from shim.install.containerd import DEFAULT_SOCKET, HostFiles

CONFIG_YAML = "/var/lib/kubelet/config.yaml"
FLAG_FILES = ("/var/lib/kubelet/kubeadm-flags.env", "/etc/default/kubelet")
KEYS = {"containerRuntimeEndpoint": "--container-runtime-endpoint", "imageServiceEndpoint": "--image-service-endpoint"}
KUBEADM_ARGS = "KUBELET_KUBEADM_ARGS"


@dataclass(frozen=True)
class KubeletPlan:
    files: dict[str, bytes]  # host path -> new content, only files that change
    endpoint_was: str  # what kubelet used before (normalised path)


def _refuse(path: str, what: str) -> UnrecognisedHost:
    return UnrecognisedHost(f"{path}: {what}; nothing was changed")


def socket_path(endpoint: str) -> str:
    """``unix:///var/run/x.sock`` and ``/run/x.sock`` are the same socket."""
    path = posixpath.normpath(endpoint.removeprefix("unix://"))
    return "/run/" + path.removeprefix("/var/run/") if path.startswith("/var/run/") else path


def _parse_env(path: str, text: str) -> dict[str, tuple[int, list[str]]]:
    """``NAME="--a=b --c"`` lines: name -> (line number, words). Anything else but comments is refused."""
    out: dict[str, tuple[int, list[str]]] = {}
    for n, line in enumerate(text.splitlines()):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", s)
        try:
            words = shlex.split(m.group(2)) if m else None
        except ValueError:
            words = None
        if m is None or words is None or len(words) > 1:
            raise _refuse(path, f"line {n + 1} is not NAME=\"--flag=value ...\"")
        out[m.group(1)] = (n, shlex.split(words[0]) if words else [])
    return out


def _flag_values(words: list[str], flag: str) -> list[str]:
    vals = []
    for i, w in enumerate(words):
        if w.startswith(flag + "="):
            vals.append(w.split("=", 1)[1])
        elif w == flag and i + 1 < len(words):
            vals.append(words[i + 1])
    return vals


def _edit_flags(path: str, text: str, flag: str, endpoint: str, add: bool) -> str:
    lines = text.splitlines(keepends=True)
    pat = re.compile(rf"({re.escape(flag)}(?:=|[ \t]+))(\"[^\"]*\"|'[^']*'|[^\s\"']+)")
    if add:
        env = _parse_env(path, text)
        if KUBEADM_ARGS not in env:
            raise _refuse(path, f"no {KUBEADM_ARGS} line to add {flag} to")
        n = env[KUBEADM_ARGS][0]
        body = lines[n].rstrip("\n")
        close = body.rstrip()[-1:] if body.rstrip()[-1:] in "\"'" else ""
        stem = body.rstrip()[:-1] if close else body.rstrip()
        sep = "" if stem.endswith(("=", '="', "='")) or stem.endswith(("\"", "'")) else " "
        lines[n] = f"{stem}{sep}{flag}={endpoint}{close}\n"
    else:
        lines = [pat.sub(lambda m: m.group(1) + endpoint, line) for line in lines]
    return "".join(lines)


def _yaml(path: str, text: str) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise _refuse(path, f"not valid YAML ({str(exc).splitlines()[0]})") from exc
    if not isinstance(doc, dict) or doc.get("kind") != "KubeletConfiguration" or not str(
            doc.get("apiVersion", "")).startswith("kubelet.config.k8s.io/"):
        kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
        raise _refuse(path, f"not a KubeletConfiguration (kind: {kind})")
    return doc


def _edit_yaml(path: str, text: str, doc: dict[str, Any], changes: dict[str, str]) -> str:
    new = text
    for key, value in changes.items():
        value_re = r"(\"[^\"\n]*\"|'[^'\n]*'|[^\s#\"'][^\n#]*?)?"
        line = re.compile(rf"^{key}:[ \t]*{value_re}([ \t]*#[^\n]*)?[ \t]*$", re.MULTILINE)
        if key in doc:
            new = line.sub(lambda m, v=value, k=key: f"{k}: {v}" + (m.group(2) or ""), new)
        else:
            new = new + ("" if not new or new.endswith("\n") else "\n") + f"{key}: {value}\n"
    try:
        ok = yaml.safe_load(new) == {**doc, **changes}
    except yaml.YAMLError:
        ok = False
    if not ok:
        raise _refuse(path, f"cannot switch {', '.join(changes)} by editing one line each "
                            "(flow style or multi-line values)")
    return new


def unswitch(path: str, current: bytes, original: bytes, agent_socket: str) -> bytes:
    """``current`` with kubelet's endpoints that point at the agent put back as ``original`` had them (a key or a
    flag weft added goes), and nothing else changed: a file someone else edited since weft's install keeps their
    edits. Refused, with the file named, where that cannot be done by editing lines in place."""
    try:
        text, was = current.decode(), original.decode()
    except UnicodeDecodeError as exc:
        raise _refuse(path, "not UTF-8 text") from exc
    ours = socket_path(agent_socket)
    if path == CONFIG_YAML:
        doc, before = _yaml(path, text), _yaml(path, was)
        new, want = text, dict(doc)
        for key in KEYS:
            if key not in doc or socket_path(str(doc[key])) != ours:
                continue
            if key in before:
                new = _edit_yaml(path, new, _yaml(path, new), {key: str(before[key])})
                want[key] = before[key]
            else:
                new = re.sub(rf"^{key}:[^\n]*\n?", "", new, flags=re.MULTILINE)
                del want[key]
        try:
            ok = yaml.safe_load(new) == want
        except yaml.YAMLError:
            ok = False
        if not ok:
            raise _refuse(path, "cannot put kubelet's endpoints back by editing one line each")
        return new.encode()
    env, before_env = _parse_env(path, text), _parse_env(path, was)
    new = text
    for flag in KEYS.values():
        used = [v for _, words in env.values() for v in _flag_values(words, flag)]
        if not any(socket_path(v) == ours for v in used):
            continue
        old = [v for _, words in before_env.values() for v in _flag_values(words, flag)]
        if old:
            new = _edit_flags(path, new, flag, old[0], add=False)
        else:
            new = re.sub(rf"[ \t]*{re.escape(flag)}(?:=|[ \t]+)(\"[^\"]*\"|'[^']*'|[^\s\"']+)", "", new)
    for _, words in _parse_env(path, new).values():
        if any(socket_path(v) == ours for flag in KEYS.values() for v in _flag_values(words, flag)):
            raise _refuse(path, "cannot put kubelet's endpoint flags back by editing them in place")
    return new.encode()


def plan(files: HostFiles, containerd_socket: str, agent_socket: str) -> KubeletPlan:
    """Switch every endpoint kubelet reads to ``unix://agent_socket``; refuse endpoints that are not containerd's."""
    agent = f"unix://{agent_socket}"
    ours = {socket_path(containerd_socket), socket_path(agent_socket)}
    texts: dict[str, str] = {}
    for path in (CONFIG_YAML, *FLAG_FILES):
        raw = files.read(path)
        if raw is not None:
            try:
                texts[path] = raw.decode()
            except UnicodeDecodeError as exc:
                raise _refuse(path, "not UTF-8 text") from exc
    if CONFIG_YAML not in texts and FLAG_FILES[0] not in texts:
        raise _refuse(CONFIG_YAML, f"not found, and no {FLAG_FILES[0]} either: kubelet's configuration is not "
                                   "where kubeadm puts it")
    doc = _yaml(CONFIG_YAML, texts[CONFIG_YAML]) if CONFIG_YAML in texts else None
    set_at: list[tuple[str, str, str]] = []  # (path, key, value)
    if doc is not None:
        set_at += [(CONFIG_YAML, k, str(doc[k])) for k in KEYS if doc.get(k)]
    for path in FLAG_FILES:
        if path in texts:
            for _, words in _parse_env(path, texts[path]).values():
                set_at += [(path, k, v) for k, flag in KEYS.items() for v in _flag_values(words, flag)]
    for path, key, value in set_at:
        if socket_path(value) not in ours:
            raise _refuse(path, f"{key} is {value}, not containerd's socket {containerd_socket}: "
                                "weft only goes between kubelet and containerd")
    runtime_set = [s for s in set_at if s[1] == "containerRuntimeEndpoint"]
    was = socket_path(runtime_set[-1][2]) if runtime_set else socket_path(DEFAULT_SOCKET)
    if not runtime_set and socket_path(containerd_socket) != socket_path(DEFAULT_SOCKET):
        raise _refuse(CONFIG_YAML, f"kubelet uses its default runtime endpoint {DEFAULT_SOCKET}, "
                                   f"but containerd serves {containerd_socket}")
    out: dict[str, bytes] = {}
    if doc is not None:
        changes = {p_k: agent for (p, p_k, _) in set_at if p == CONFIG_YAML}
        if not runtime_set:
            changes["containerRuntimeEndpoint"] = agent
        if changes:
            new = _edit_yaml(CONFIG_YAML, texts[CONFIG_YAML], doc, changes)
            if new != texts[CONFIG_YAML]:
                out[CONFIG_YAML] = new.encode()
    for path in FLAG_FILES:
        if path not in texts:
            continue
        new = texts[path]
        for key, flag in KEYS.items():
            if any(p == path and k == key for p, k, _ in set_at):
                new = _edit_flags(path, new, flag, agent, add=False)
        if doc is None and not runtime_set and path == FLAG_FILES[0]:
            new = _edit_flags(path, new, KEYS["containerRuntimeEndpoint"], agent, add=True)
        env = _parse_env(path, new)
        if any(socket_path(v) != socket_path(agent_socket)
               for _, words in env.values() for flag in KEYS.values() for v in _flag_values(words, flag)):
            raise _refuse(path, "cannot switch the runtime endpoint flags by editing them in place")
        if new != texts[path]:
            out[path] = new.encode()
    return KubeletPlan(files=out, endpoint_was=was)
