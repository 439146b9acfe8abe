"""Parse the WORKLOAD argument: ``deployment/NAME`` (and the other controllers) or a pod label selector.

Only equality selectors (``app=x,tier!=debug``) are taken: they map one to one
onto kube-state-metrics' ``kube_pod_labels`` series, which is how Prometheus
knows a pod's labels. Set-based terms are refused with a message rather than
half-supported.
"""

from __future__ import annotations

import re

from shim.report.errors import UsageError
from shim.report.model import CONTROLLERS, Matcher, Workload

_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_LABEL = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_ALIASES = {"deploy": "deployment", "sts": "statefulset", "ds": "daemonset", "rs": "replicaset"}
_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


def parse(spec: str, namespace: str) -> Workload:
    spec = spec.strip()
    if not _NAME.fullmatch(namespace or ""):
        raise UsageError(f"--namespace: {namespace!r} is not a namespace name")
    if "=" in spec:
        return Workload(namespace=namespace, selector=_selector(spec))
    kind, sep, name = spec.partition("/")
    kinds = ", ".join(f"{k}/NAME" for k in CONTROLLERS)
    if not sep:
        raise UsageError(f"WORKLOAD: {spec!r} is neither a controller ({kinds}) nor a pod label selector "
                         "(app=NAME[,label=value...])")
    kind = _ALIASES.get(kind.lower(), kind.lower())
    if kind not in CONTROLLERS and kind.removesuffix("s") in CONTROLLERS:  # kubectl takes plurals too
        kind = kind.removesuffix("s")
    if kind not in CONTROLLERS:
        raise UsageError(f"WORKLOAD: {spec.partition('/')[0]!r} is not a controller kind weft reports on "
                         f"(use {kinds}, or a pod label selector)")
    if not _NAME.fullmatch(name):
        raise UsageError(f"WORKLOAD: {name!r} is not a {kind} name")
    return Workload(namespace=namespace, kind=kind, name=name)


def _selector(spec: str) -> tuple[Matcher, ...]:
    terms = []
    for raw in spec.split(","):
        term = raw.strip()
        m = re.fullmatch(r"(?P<label>[^=!\s]+)\s*(?P<op>==|!=|=)\s*(?P<value>\S*)", term)
        if not m or " in " in term or " notin " in term:
            raise UsageError(f"WORKLOAD: selector term {term!r} is not label=value or label!=value "
                             "(set-based selectors are not supported)")
        label, op, value = m["label"], m["op"], m["value"]
        if not _LABEL.fullmatch(label):
            raise UsageError(f"WORKLOAD: {label!r} is not a label name")
        if not _VALUE.fullmatch(value):
            raise UsageError(f"WORKLOAD: {value!r} is not a label value (in {term!r})")
        terms.append(Matcher(label, "!=" if op == "!=" else "=", value))
    if not any(t.op == "=" for t in terms):
        raise UsageError(f"WORKLOAD: selector {spec!r} needs at least one label=value term")
    return tuple(terms)


def ksm_label(label: str) -> str:
    """kube-state-metrics' name for a pod label: ``label_`` plus the name with every other character as ``_``."""
    return "label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def backout(w: Workload) -> str:
    """The exact step that takes the workload back out of weft."""
    if w.kind in ("deployment", "statefulset", "daemonset", "replicaset"):
        return (f"remove `runtimeClassName: weft` from the pod template: kubectl -n {w.namespace} patch {w.kind} "
                f"{w.name} --type=json -p '[{{\"op\":\"remove\",\"path\":\"/spec/template/spec/runtimeClassName\"}}]'"
                " (pods are replaced by the controller's rollout)")
    if w.kind == "job":
        return (f"remove `runtimeClassName: weft` from the Job's pod template; a Job's template cannot be "
                f"changed, so recreate it: kubectl -n {w.namespace} get job {w.name} -o yaml, delete the "
                "runtimeClassName line, kubectl replace --force -f FILE")
    return (f"remove `runtimeClassName: weft` from the pod spec of whatever creates the pods with "
            f"{','.join(map(str, w.selector))} in namespace {w.namespace}, then recreate those pods")
