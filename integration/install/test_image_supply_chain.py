"""What a node pulls, checked as a cluster would: the image's SBOM, attached to it in a registry, and its signature.

The node image is built as ``integration/install/test_nodeimage.py`` builds it (``nodeimage.build.build``, the
default base; warm caches make it a rebuild of seconds, byte for byte the same image), pushed with skopeo to a
real registry (the harness's ``Registry``: Debian's docker-registry, distribution 2.8, with htpasswd auth, in a
throwaway containerd's network namespace). Then, with the tools built from the Go module proxy
(``components/syft``, ``components/oras``, ``components/cosign``; a test that gets here before the background
build waits for it or builds it):

- ``nodeimage.build.sbom`` writes the CycloneDX SBOM (syft on the archive, completed with what syft cannot see
  in an image made without dpkg): weft's Python packages with versions and hashes, the base's Debian packages,
  the native OCI hook;
- ``oras attach`` attaches it to the image by digest as an artifact that refers to the image; distribution 2.8
  has no referrers API, so it goes under the referrers tag scheme (tag ``sha256-<digest>``), which ``oras
  discover`` reads back, and ``oras pull`` fetches the SBOM by its own digest, byte for byte;
- ``cosign`` signs the image by digest with a key pair made here (no transparency log: keyless signing needs
  services these machines cannot reach), attests the SBOM (in-toto, CycloneDX predicate) and signs the SBOM's
  artifact; ``cosign verify --key`` accepts each, and refuses, saying what is wrong, the tag moved to another
  image with the first one's signature copied beside it, an image nobody signed, and a signature made with
  another key.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.fixture import report
from harness.registry import Registry
from nodeimage import build
from nodeimage.build import sbom as image_sbom
from shim.localfabric import builds, images
from shim.localfabric.containerd import IMAGE_CACHE, Containerd

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SBOM_TYPE = "application/vnd.cyclonedx+json"
REPOSITORY = "weft/node"


def _tool(name: str) -> str:
    """components/NAME/build.sh's binary: built now, or waited for under its cache's lock."""
    script = REPO / "components" / name / "build.sh"
    builds.run(script)
    path = Path(builds.run(script, "--bin-dir")) / name
    assert path.is_file(), f"{script} did not build {path}"
    return str(path)


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> build.Built:
    try:
        return build.build(tmp_path_factory.mktemp("nodeimage"))
    except build.BuildError as exc:
        pytest.fail(f"building the node image failed (a first build needs apt's mirror and the package index; "
                    f"later builds use /var/cache/weft/nodeimage): {exc}")


@pytest.fixture(scope="module")
def sbom(request, archive: build.Built) -> dict:
    started = time.monotonic()
    path = image_sbom.make_sbom(archive.archive, syft=Path(_tool("syft")))
    assert path == archive.archive.with_name("weft-image.cdx.json")
    doc = json.loads(path.read_text())
    report(request.config, f"node image SBOM: {len(doc['components'])} components, made in "
                           f"{time.monotonic() - started:.1f} s ({path.stat().st_size // 1024} KiB)")
    return doc


@dataclass
class Pushed:
    registry: Registry
    work: Path
    env: dict[str, str]
    netns: list[str]
    ref: str  # 127.0.0.1:5000/weft/node:0.1.0
    digest: str  # the image's, as the registry serves it

    @property
    def by_digest(self) -> str:
        return f"{self.registry.host}/{REPOSITORY}@{self.digest}"

    def run(self, *argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([*self.netns, *argv], capture_output=True, text=True, env=self.env, cwd=self.work,
                             timeout=timeout)
        if check:
            assert res.returncode == 0, f"{' '.join(argv[:3])} ... failed ({res.returncode}): {res.stderr[-3000:]}"
        return res

    def oras(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(_tool("oras"), *args, "--plain-http", "--registry-config",
                        str(self.work / "docker" / "config.json"), check=check)

    def cosign(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(_tool("cosign"), *args, check=check)

    def skopeo_copy(self, src: str, dest: str) -> None:
        creds = f"{self.registry.user}:{self.registry.password}"
        self.run("skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false",
                 f"--src-creds={creds}", f"--dest-creds={creds}", f"docker://{src}", f"docker://{dest}")


@pytest.fixture(scope="module")
def pushed(containerd_session: Containerd, archive: build.Built, tmp_path_factory) -> Iterator[Pushed]:
    work = tmp_path_factory.mktemp("supply-chain")
    with Registry(containerd_session) as reg:
        (work / "docker").mkdir()
        auth = base64.b64encode(f"{reg.user}:{reg.password}".encode()).decode()
        (work / "docker" / "config.json").write_text(json.dumps({"auths": {reg.host: {"auth": auth}}}))
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work),
               "DOCKER_CONFIG": str(work / "docker"),
               "TUF_ROOT": str(work / "tuf"), "COSIGN_PASSWORD": "", "SYFT_CHECK_FOR_APP_UPDATE": "false"}
        p = Pushed(reg, work, env, ["nsenter", f"--net={containerd_session.netns_path}"], "", "")
        p.ref = reg.push(archive.archive, f"{REPOSITORY}:0.1.0")
        p.digest = p.oras("resolve", p.ref).stdout.strip()
        # skopeo gzips the layers as it pushes, so the registry's digest is its own; its config is the build's
        # (the same diff_ids: the same files).
        manifest = json.loads(p.oras("manifest", "fetch", p.by_digest).stdout)
        assert manifest["config"]["digest"] == build.Layout(archive.layout).image()[0]["config"]["digest"]
        yield p


@pytest.fixture(scope="module")
def keys(pushed: Pushed) -> tuple[Path, Path]:
    """(cosign.key, cosign.pub) and another pair in other/: made here, with an empty password."""
    (pushed.work / "other").mkdir()
    for where in (pushed.work, pushed.work / "other"):
        res = subprocess.run([_tool("cosign"), "generate-key-pair"], cwd=where, env=pushed.env, capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, f"cosign generate-key-pair: {res.stderr}"
    return pushed.work / "cosign.key", pushed.work / "cosign.pub"


@pytest.fixture(scope="module")
def attached(pushed: Pushed, archive: build.Built, sbom: dict) -> str:
    """The SBOM attached to the image by digest; the digest of the artifact's manifest."""
    path = archive.archive.with_name("weft-image.cdx.json")
    pushed.run("cp", str(path), str(pushed.work / path.name))
    out = pushed.oras("attach", "--artifact-type", SBOM_TYPE, "--format", "json", pushed.by_digest,
                      f"{path.name}:{SBOM_TYPE}").stdout
    return json.loads(out)["digest"]


@pytest.fixture(scope="module")
def signed(pushed: Pushed, keys: tuple[Path, Path], attached: str, archive: build.Built) -> Pushed:
    key = str(keys[0])
    common = ["--key", key, "--tlog-upload=false", "--allow-http-registry", "--yes"]
    pushed.cosign("sign", *common, pushed.by_digest)
    pushed.cosign("attest", *common, "--type", "cyclonedx", "--predicate",
                  str(archive.archive.with_name("weft-image.cdx.json")), pushed.by_digest)
    pushed.cosign("sign", *common, f"{pushed.registry.host}/{REPOSITORY}@{attached}")
    return pushed


def _verify(pushed: Pushed, ref: str, pub: Path, *more: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return pushed.cosign("verify", "--key", str(pub), "--insecure-ignore-tlog", "--allow-http-registry",
                         *more, ref, check=check)


def _names(doc: dict) -> set[str]:
    return {c["name"] for c in doc["components"]}


def test_the_sbom_names_the_python_packages_with_versions_and_hashes(sbom: dict) -> None:
    assert sbom["bomFormat"] == "CycloneDX" and sbom["specVersion"] >= "1.5"
    by_purl = {c.get("purl", "").split("?")[0]: c for c in sbom["components"]}
    locked = image_sbom.locked_wheels()
    machines = image_sbom._wheel_arches(build.CACHE)
    assert len(locked) > 10
    for name, version, hashes in locked.values():
        comp = by_purl.get(f"pkg:pypi/{image_sbom._normalise(name)}@{version}") or next(
            (c for p, c in by_purl.items() if p.lower() == f"pkg:pypi/{name.lower()}@{version}"), None)
        assert comp is not None, f"{name}=={version} of requirements.lock is not in the SBOM"
        # The lock holds a wheel's hash per architecture where they differ: the SBOM names amd64's.
        mine = {h for h in hashes if machines.get(h) in ("x86_64", "any")}
        assert mine and mine <= {h["content"] for h in comp.get("hashes", [])}, f"{name}: the lock's hash"
        assert not set(hashes) - mine & {h["content"] for h in comp["hashes"]}, f"{name}: another arch's wheel"
    # syft found them itself (their dist-info in /opt/weft/lib), not only the lock.
    found = [c for c in sbom["components"] if c.get("purl", "").startswith("pkg:pypi/")
             and {"name": image_sbom.SOURCE, "value": "requirements.lock"} not in c.get("properties", [])]
    assert len(found) >= len(locked)


def test_the_sbom_names_the_debian_packages_and_the_hook(sbom: dict, archive: build.Built) -> None:
    debs = {c["name"]: c for c in sbom["components"] if c.get("purl", "").startswith("pkg:deb/debian/")}
    for pkg in ("python3.11-minimal", "libpython3.11-stdlib", "libc6", "dash", "coreutils", "util-linux", "tini"):
        assert pkg in debs, f"Debian package {pkg} is not in the SBOM"
    image = image_sbom._Archive(archive.archive)
    _, base = image.base_packages()  # what the base was made of: the pins, or apt's where the mirror moved on
    assert {n: debs[n]["version"] for n in base} == base
    assert len(debs) == len(base) + len(build.read_pins().init)
    # syft's own finds beside them: the interpreter, by its binary.
    assert "pkg:generic/python@3.11" in {c.get("purl", "")[:len("pkg:generic/python@3.11")] for c in sbom["components"]}
    (hook,) = [c for c in sbom["components"] if c["name"] == "weft-oci-hook"]
    layer_hook = image.file(image_sbom.HOOK_PATH)
    assert layer_hook is not None
    assert hook["hashes"] == [{"alg": "SHA-256", "content": hashlib.sha256(layer_hook).hexdigest()}]
    assert len(sbom["components"]) > 100


def test_the_sbom_is_attached_to_the_image_and_read_back_by_digest(pushed: Pushed, attached: str,
                                                                   archive: build.Built, tmp_path: Path) -> None:
    # distribution 2.8 has no referrers API: the referrers tag scheme's index, tag sha256-<hex>, lists it.
    tags = pushed.oras("repo", "tags", f"{pushed.registry.host}/{REPOSITORY}").stdout.split()
    assert pushed.digest.replace(":", "-") in tags
    found = json.loads(pushed.oras("discover", "--format", "json", "--artifact-type", SBOM_TYPE,
                                   pushed.by_digest).stdout)
    referrers = found.get("referrers", found.get("manifests", []))
    assert [r["digest"] for r in referrers] == [attached]
    out = pushed.work / "pulled"
    pushed.oras("pull", "-o", str(out), f"{pushed.registry.host}/{REPOSITORY}@{attached}")
    assert (out / "weft-image.cdx.json").read_bytes() == archive.archive.with_name("weft-image.cdx.json").read_bytes()
    manifest = json.loads(pushed.oras("manifest", "fetch", f"{pushed.registry.host}/{REPOSITORY}@{attached}").stdout)
    assert manifest["subject"]["digest"] == pushed.digest and manifest["artifactType"] == SBOM_TYPE


def test_the_signed_image_and_its_sbom_verify(signed: Pushed, keys: tuple[Path, Path], attached: str,
                                              sbom: dict) -> None:
    out = _verify(signed, signed.by_digest, keys[1]).stdout
    (claim,) = json.loads(out)
    assert claim["critical"]["image"]["docker-manifest-digest"] == signed.digest
    # By tag too, while the tag is the signed digest.
    _verify(signed, signed.ref, keys[1])
    # The SBOM's attestation: its predicate is the SBOM.
    att = signed.cosign("verify-attestation", "--key", str(keys[1]), "--insecure-ignore-tlog",
                        "--allow-http-registry", "--type", "cyclonedx", signed.by_digest).stdout
    statement = json.loads(base64.b64decode(json.loads(att.splitlines()[0])["payload"]))
    assert statement["subject"][0]["digest"]["sha256"] == signed.digest.removeprefix("sha256:")
    assert len(statement["predicate"]["components"]) == len(sbom["components"])
    # The SBOM's artifact, signed by its own digest.
    _verify(signed, f"{signed.registry.host}/{REPOSITORY}@{attached}", keys[1])


def _said(res: subprocess.CompletedProcess[str]) -> str:
    return res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""


def test_verify_refuses_a_moved_tag_an_unsigned_image_and_another_key(request, signed: Pushed,
                                                                      keys: tuple[Path, Path]) -> None:
    host = signed.registry.host
    (busybox,) = [a for a in images.cached_archives(IMAGE_CACHE) if "busybox" in a.name]
    # An unsigned image.
    unsigned = signed.registry.push(busybox, "weft/unsigned:1")
    res = _verify(signed, unsigned, keys[1], check=False)
    assert res.returncode != 0 and "no signatures found" in res.stderr, res.stderr
    report(request.config, f"cosign verify, an unsigned image: {_said(res)}")
    # Another key's signature on the signed image.
    res = _verify(signed, signed.by_digest, keys[0].parent / "other" / "cosign.pub", check=False)
    assert res.returncode != 0 and "no matching signatures" in res.stderr, res.stderr
    assert "invalid signature" in res.stderr or "verification error" in res.stderr, res.stderr
    report(request.config, f"cosign verify, another key: {_said(res)}")
    # The tag moved to another image (another digest), the first one's signature copied beside it.
    other_digest = signed.oras("resolve", unsigned).stdout.strip()
    signed.skopeo_copy(unsigned, signed.ref)
    assert signed.oras("resolve", signed.ref).stdout.strip() == other_digest != signed.digest
    res = _verify(signed, signed.ref, keys[1], check=False)  # no signature of its own
    assert res.returncode != 0 and "no signatures found" in res.stderr, res.stderr
    signed.skopeo_copy(f"{host}/{REPOSITORY}:{signed.digest.replace(':', '-')}.sig",
                       f"{host}/{REPOSITORY}:{other_digest.replace(':', '-')}.sig")
    res = _verify(signed, signed.ref, keys[1], check=False)
    assert res.returncode != 0 and "invalid or missing digest in claim" in res.stderr, res.stderr
    report(request.config, f"cosign verify, the tag moved with the signature copied: {_said(res)}")
    # The signed digest itself still verifies.
    _verify(signed, signed.by_digest, keys[1])


# -- the multi-architecture image: amd64 and arm64 under one digest ----------------------------------------------
@pytest.fixture(scope="module")
def multi(pushed: Pushed, tmp_path_factory) -> tuple[build.Built, dict[str, Path], str]:
    """The amd64 and arm64 image built as one index, an SBOM per architecture, pushed whole (``skopeo copy --all
    --preserve-digests``: the registry serves the digests the build printed); (built, {arch: SBOM}, reference)."""
    both = build.build(tmp_path_factory.mktemp("nodeimage-both"), platforms="linux/amd64,linux/arm64")
    sboms = {i.arch: image_sbom.make_sbom(both.archive, syft=Path(_tool("syft")), arch=i.arch) for i in both.images}
    ref = f"{pushed.registry.host}/{REPOSITORY}:0.1.0-multi"
    pushed.run("skopeo", "copy", "--quiet", "--all", "--preserve-digests", "--dest-tls-verify=false",
               f"--dest-creds={pushed.registry.user}:{pushed.registry.password}", f"oci-archive:{both.archive}",
               f"docker://{ref}", timeout=300)
    return both, sboms, ref


def test_the_multi_architecture_image_is_signed_whole_and_each_architecture_carries_its_own_sbom(
        request, pushed: Pushed, keys: tuple[Path, Path], multi: tuple[build.Built, dict[str, Path], str]) -> None:
    both, sboms, ref = multi
    host, key, pub = pushed.registry.host, str(keys[0]), keys[1]
    assert pushed.oras("resolve", ref).stdout.strip() == both.manifest_digest  # the build's digest, as served
    index = json.loads(pushed.oras("manifest", "fetch", ref).stdout)
    assert [(m["digest"], m["platform"]["architecture"]) for m in index["manifests"]] == [
        (i.manifest_digest, i.arch) for i in both.images]
    by = {i.arch: f"{host}/{REPOSITORY}@{i.manifest_digest}" for i in both.images}
    common = ["--key", key, "--tlog-upload=false", "--allow-http-registry", "--yes"]
    # Each architecture's SBOM refers to its own image's digest, and says so itself (syft's subject).
    for arch, path in sboms.items():
        doc = json.loads(path.read_text())
        assert doc["metadata"]["component"]["version"] == by[arch].split("@")[1]
        pushed.run("cp", str(path), str(pushed.work / path.name))
        pushed.oras("attach", "--artifact-type", SBOM_TYPE, by[arch], f"{path.name}:{SBOM_TYPE}")
        found = json.loads(pushed.oras("discover", "--format", "json", "--artifact-type", SBOM_TYPE,
                                       by[arch]).stdout)
        assert len(found.get("referrers", found.get("manifests", []))) == 1, found
    # One signature over the index and, --recursive, each architecture's image: a node verifies what it pulls.
    pushed.cosign("sign", *common, "--recursive", f"{host}/{REPOSITORY}@{both.manifest_digest}")
    for target in (f"{host}/{REPOSITORY}@{both.manifest_digest}", by["amd64"], by["arm64"]):
        (claim,) = json.loads(_verify(pushed, target, pub).stdout)
        assert claim["critical"]["image"]["docker-manifest-digest"] == target.split("@")[1]
    # An SBOM attested for another digest is refused: amd64's attestation put beside arm64's image.
    pushed.cosign("attest", *common, "--type", "cyclonedx", "--predicate", str(sboms["amd64"]), by["amd64"])
    pushed.skopeo_copy(f"{host}/{REPOSITORY}:{by['amd64'].split('@')[1].replace(':', '-')}.att",
                       f"{host}/{REPOSITORY}:{by['arm64'].split('@')[1].replace(':', '-')}.att")
    attest = ["verify-attestation", "--key", str(pub), "--insecure-ignore-tlog", "--allow-http-registry",
              "--type", "cyclonedx"]
    res = pushed.cosign(*attest, by["arm64"], check=False)
    assert res.returncode != 0, res.stdout
    report(request.config, f"cosign verify-attestation, an SBOM attested for another digest: {_said(res)}")
    # Its own, attested for it, verifies.
    pushed.cosign("attest", *common, "--replace", "--type", "cyclonedx", "--predicate", str(sboms["arm64"]),
                  by["arm64"])
    att = pushed.cosign(*attest, by["arm64"]).stdout
    statements = [json.loads(base64.b64decode(json.loads(ln)["payload"])) for ln in att.splitlines() if ln.strip()]
    assert {s["subject"][0]["digest"]["sha256"] for s in statements} == {by["arm64"].split(":")[-1]}


# -- a registry with the OCI 1.1 referrers API --------------------------------------------------------------------
@pytest.fixture
def referrers_registry() -> Iterator[str]:
    """components/ociregistry (go-containerregistry's registry with its referrers API on, and what distribution-
    spec 1.1 asks of it besides), on a free localhost port; its host:port."""
    proc = subprocess.Popen([_tool("ociregistry"), "--address", "127.0.0.1:0"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("serving on "), f"ociregistry said {line!r} ({proc.poll()})"
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # and its stdout closed


def test_on_a_registry_with_the_referrers_api_the_sbom_is_listed_there_and_no_tag_is_made(
        archive: build.Built, sbom: dict, referrers_registry: str, tmp_path: Path) -> None:
    """Where the registry has the referrers API, ``oras attach`` uses it (the push is answered with OCI-Subject):
    the SBOM is listed by ``GET /v2/<name>/referrers/<digest>``, no ``sha256-<digest>`` tag is made, and ``oras
    discover``/``pull`` read it back as from the tag scheme's registry."""
    host = referrers_registry
    oras = [_tool("oras"), "--plain-http"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}

    def run(*argv: str) -> str:
        res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
        assert res.returncode == 0, f"{' '.join(argv[:3])} ... failed: {res.stderr[-2000:]}"
        return res.stdout

    run("skopeo", "copy", "--quiet", "--preserve-digests", "--dest-tls-verify=false",
        f"oci-archive:{archive.archive}", f"docker://{host}/{REPOSITORY}:0.1.0")
    image = f"{host}/{REPOSITORY}@{archive.manifest_digest}"  # the build's digest, pushed as it is
    path = archive.archive.with_name("weft-image.cdx.json")
    (tmp_path / path.name).write_bytes(path.read_bytes())
    attached = json.loads(run(oras[0], "attach", *oras[1:], "--artifact-type", SBOM_TYPE, "--format", "json",
                              image, f"{path.name}:{SBOM_TYPE}"))["digest"]
    query = urllib.parse.urlencode({"artifactType": SBOM_TYPE})
    with urllib.request.urlopen(f"http://{host}/v2/{REPOSITORY}/referrers/{archive.manifest_digest}?{query}",
                                timeout=30) as resp:
        listed = json.loads(resp.read())
    assert [(m["digest"], m["artifactType"]) for m in listed["manifests"]] == [(attached, SBOM_TYPE)]
    with urllib.request.urlopen(f"http://{host}/v2/{REPOSITORY}/tags/list", timeout=30) as resp:
        assert json.loads(resp.read())["tags"] == ["0.1.0"], "no referrers tag where the API is there"
    found = json.loads(run(oras[0], "discover", *oras[1:], "--format", "json", "--artifact-type", SBOM_TYPE, image))
    assert [r["digest"] for r in found.get("referrers", found.get("manifests", []))] == [attached]
    run(oras[0], "pull", *oras[1:], "-o", str(tmp_path / "pulled"), f"{host}/{REPOSITORY}@{attached}")
    assert (tmp_path / "pulled" / path.name).read_bytes() == path.read_bytes()
