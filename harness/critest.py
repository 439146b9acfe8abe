"""critest (cri-tools' CRI validation suite) with its offline image set, and a comparison of two runs.

critest pulls a few dozen images from ``registry.k8s.io/e2e-test-images`` and
``gcr.io/k8s-staging-cri-tools``. Nothing can be pulled from there here, so ``critest_images``
builds stand-ins from the local fabric's busybox layer, as cri-tools' own ``images/build`` script
describes them (a file per ``test-image-*`` image so that each is distinct, the users and groups of
the ``test-image-user-*`` and ``-predefined-group`` images, web servers on the ports the networking
specs dial), and the test pushes them to a local registry that both containerds reach under those
registry names (``hosts.toml``). The digest-pinned ``test-image-digest`` cannot be rebuilt to the
same digest, and ``nonewprivs`` is a program of its own: the specs on them fail against containerd
directly too, which is what the comparison allows for.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from harness import binaries
from shim.localfabric import images

E2E = "registry.k8s.io/e2e-test-images/"
CRI_TOOLS = "gcr.io/k8s-staging-cri-tools/"
REGISTRY_HOSTS = ("registry.k8s.io", "gcr.io")
# A spec that fails is run once more before it counts as failed, on both sides alike: containerd 1.6 now
# and then fails a StopPodSandbox with "ttrpc: closed" when a container's shim goes away under it.
# The specs that passed only at the second attempt are reported (``flaky``).
FLAKE_ATTEMPTS = 2


def _web(port: int, name: str) -> tuple[str, ...]:
    """A web server on ``port`` under a shell that, like nginx, writes its pid to /var/run/nginx.pid, says
    "master process" in its command line (the PID-namespace specs look for both) and stops on TERM."""
    return ("sh", "-c", f'mkdir -p /var/run; echo $$ > /var/run/nginx.pid; trap "exit 0" TERM INT; '
                        f'echo "{name} starting: master process"; httpd -f -p {port} -h /www & wait')


def critest_images(out: Path) -> dict[str, Path]:
    """Reference (as critest pulls it) -> OCI archive, built once into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    base = images.busybox_layer(passwd="www-data:x:33:33:www-data:/var/www:/bin/false\n"
                                       "default-user:x:1000:1000::/home/default-user:/bin/sh\n",
                                group="www-data:x:33:\ndefault-user:x:1000:\n"
                                      "group-defined-in-image:x:50000:default-user\n")
    page = images.files_layer({"www/index.html": b"<html><body>Welcome to nginx!</body></html>\n"})
    specs: dict[str, tuple[images.ImageSpec, tuple[bytes, ...]]] = {
        E2E + "busybox:1.29-2": (images.ImageSpec("", ("sh",)), ()),
        E2E + "nginx:1.14-2": (images.ImageSpec("", _web(80, "nginx")), (page,)),
        E2E + "httpd:2.4.39-4": (images.ImageSpec("", _web(80, "httpd")), (page,)),
        E2E + "nonewprivs:1.3": (images.ImageSpec("", ("sh",)), ()),
        CRI_TOOLS + "hostnet-nginx-amd64:latest": (images.ImageSpec("", _web(12003, "nginx")), (page,)),
        CRI_TOOLS + "test-image-predefined-group:latest": (images.ImageSpec("", ("sh",), user="1000"), ()),
    }
    for name, user in (("test-image-user-uid", "1002"), ("test-image-user-username", "www-data"),
                       ("test-image-user-uid-group", "1003:1004"), ("test-image-user-username-group", "www-data:1004")):
        specs[CRI_TOOLS + name + ":latest"] = (images.ImageSpec("", ("sh",), user=user), ())
    for name in ("test-image-1", "test-image-2", "test-image-3", "test-image-latest", "test-image-digest"):
        specs[CRI_TOOLS + name + ":latest"] = (images.ImageSpec("", ("sh",)), (images.files_layer({name: b""}),))
    for name, tags in (("test-image-tags", ("1", "2", "3")), ("test-image-tag", ("test", "all"))):
        for tag in tags:  # the same image under each tag
            specs[CRI_TOOLS + f"{name}:{tag}"] = (images.ImageSpec("", ("sh",)), (images.files_layer({name: b""}),))
    archives = {}
    for ref, (spec, extra) in specs.items():
        path = out / (ref.replace("/", "_").replace(":", "_") + ".tar")
        if not path.exists():
            images.build_archive(images.ImageSpec(ref, spec.cmd, spec.user), path, base, extra)
        archives[ref] = path
    return archives


def repository_path(ref: str) -> str:
    """``registry.k8s.io/e2e-test-images/busybox:1.29-2`` -> ``e2e-test-images/busybox:1.29-2``."""
    return ref.split("/", 1)[1]


@dataclass
class CritestRun:
    name: str
    proc: subprocess.Popen[bytes]
    report: Path
    log: Path

    flaky: list[str] = field(default_factory=list)

    def wait(self, timeout: float) -> dict[str, str]:
        """Spec (its full text) -> how it ended: passed, failed, skipped, ...

        ``flaky`` lists those that passed only at the second attempt.
        """
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"critest {self.name} still running after {timeout:g} s; see {self.log}") from None
        if not self.report.exists():
            raise AssertionError(f"critest {self.name} exited {self.proc.returncode} without a report; "
                                 f"{self.log}:\n{self.log.read_text(errors='replace')[-3000:]}")
        outcomes = {}
        for suite in json.loads(self.report.read_text()):
            for spec in suite.get("SpecReports") or []:
                if spec.get("LeafNodeType") != "It":
                    continue
                text = " ".join([*(spec.get("ContainerHierarchyTexts") or []), spec.get("LeafNodeText", "")])
                outcomes[text] = spec["State"]
                if spec.get("NumAttempts", 1) > 1 and spec["State"] == "passed":
                    self.flaky.append(text)
        return outcomes


def start_critest(name: str, endpoint: Path, netns: Path, workdir: Path) -> CritestRun:
    """critest against a CRI socket, inside the node's network namespace (where its streaming URLs answer)."""
    workdir.mkdir(parents=True, exist_ok=True)
    report, log = workdir / f"critest-{name}.json", workdir / f"critest-{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["nsenter", f"--net={netns}", binaries.binary("critest"), f"--runtime-endpoint=unix://{endpoint}",
             f"--image-endpoint=unix://{endpoint}", f"--ginkgo.json-report={report}", "--ginkgo.no-color",
             "--ginkgo.timeout=30m", f"--ginkgo.flake-attempts={FLAKE_ATTEMPTS}"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir, start_new_session=True)
    return CritestRun(name, proc, report, log)
