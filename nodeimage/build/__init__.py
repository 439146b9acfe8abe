"""Build the weft node image as an OCI archive, without a container engine.

There is no docker, podman or buildah on the machines weft is developed and
tested on, so this builds the image that ``nodeimage/Containerfile`` describes
by reading that file and doing what an engine would:

- **base**: by default (``--base debian-packages``) a Python 3.11 base made from Debian bookworm's own
  packages (Python 3.11, dash, coreutils, util-linux and what they depend on), at exactly the versions
  ``nodeimage/debian-packages.pins`` names, downloaded with ``apt-get download`` (which works wherever apt
  does) into ``/var/cache/weft/nodeimage/debs/`` and unpacked into one layer; the made base is cached under
  ``/var/cache/weft/nodeimage/bases/`` by those versions, so later builds are offline. That is the base every
  test builds on. ``--base containerfile`` takes the Containerfile's ``ARG BASE`` instead (a
  ``python:3.11-slim-bookworm`` pinned by digest, copied with ``skopeo``: the base a container engine would
  use; it has not been fetched or tested here); ``--base oci:DIR`` takes any OCI layout.
- **RUN**: the Containerfile's one RUN line, ``pip install --target
  /opt/weft/lib -r requirements.lock``, run on this host with pip's
  ``--platform`` options, so the wheels are the manylinux/cp311 ones the base's
  Python needs; wheels are cached under ``/var/cache/weft/nodeimage/wheels/``.
- **the ``hook`` stage**: its one file, ``hooks/weft_oci_hook.c``, compiled on
  this host with the flags its RUN line names (``hooks.native``: static, so
  the binary needs nothing of the base); ``COPY --from=hook`` takes it.
- **the ``init`` stage**: ``/usr/bin/tini-static`` from Debian's ``tini``
  package, which its RUN line installs, here unpacked from the package
  (``apt-get download`` of the pinned version; cached under
  ``/var/cache/weft/nodeimage/debs/``); ``COPY --from=init`` takes it, and the
  ENTRYPOINT runs weft under it.
- **COPY, ENV, LABEL, USER, ENTRYPOINT, CMD**: applied as the Containerfile says
  (COPY honours ``nodeimage/containerignore``).

The build is reproducible: the same tree and pins give the same image digest and the same archive, byte for
byte. Every layer and the archive are uncompressed tars, sorted, owner root, without extended headers, modes
fixed; the image's one date (its config's ``created`` and the weft layer's file times) is
``$SOURCE_DATE_EPOCH`` or else the last commit's time (``common.source_date_epoch``), never the build's; pip
installs the hash-locked wheels without compiling (no ``.pyc``) and the RECORD lines of the scripts the RUN line
deletes go with them (their hashes carry the build host's interpreter path); the Debian packages are the pinned
ones, and the hook's toolchain is checked against the pins' ``[host]``. The output is an OCI layout and
``weft-image.oci.tar`` (that layout as a tar, with the ``io.containerd.image.name`` annotation ``ctr images
import`` uses). ``--platform linux/amd64,linux/arm64`` makes one multi-architecture image, an index of the two,
each built as above from its own architecture's packages, wheels, hook (cross-compiled) and tini; the amd64
image in it is the same, byte for byte, as a plain build's::

    python -m nodeimage.build --out DIR [--base debian-packages|containerfile|oci:DIR|docker://REF] [--name REF]
                              [--platform linux/amd64[,linux/arm64]] [--sbom]
    python -m nodeimage.build lock      # rewrite nodeimage/requirements.lock from the venv's versions
    python -m nodeimage.build pins      # rewrite nodeimage/debian-packages.pins from apt's candidates
"""

from nodeimage.build.base import build_debian_base, debian_closure, fetch_registry_base, resolve_base
from nodeimage.build.common import (
    ARCHIVE_NAME,
    CACHE,
    CONTAINERFILE,
    CONTAINERFILE_BASE,
    DEFAULT_BASE,
    DEFAULT_NAME,
    IGNOREFILE,
    LOCKFILE,
    PINFILE,
    REPO,
    BuildError,
    parse_platforms,
    rfc3339,
    source_date_epoch,
)
from nodeimage.build.containerfile import Plan, ignore_patterns, parse_containerfile
from nodeimage.build.image import Built, archive_digest, build, image_config
from nodeimage.build.layer import pip_install, weft_layer
from nodeimage.build.layout import Layout
from nodeimage.build.lock import runtime_closure, write_lock
from nodeimage.build.pins import Pins, read_pins, write_pins

__all__ = ["ARCHIVE_NAME", "CACHE", "CONTAINERFILE", "CONTAINERFILE_BASE", "DEFAULT_BASE", "DEFAULT_NAME",
           "IGNOREFILE", "LOCKFILE", "PINFILE", "REPO", "BuildError", "Built", "Layout", "Pins", "Plan",
           "archive_digest", "build", "build_debian_base", "debian_closure", "fetch_registry_base", "ignore_patterns",
           "image_config", "parse_containerfile", "parse_platforms", "pip_install", "read_pins", "resolve_base",
           "rfc3339", "runtime_closure", "source_date_epoch", "weft_layer", "write_lock", "write_pins"]
