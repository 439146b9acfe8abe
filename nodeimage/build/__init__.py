"""Build the weft node image as an OCI archive, without a container engine.

There is no docker, podman or buildah on the machines weft is developed and
tested on, so this builds the image that ``nodeimage/Containerfile`` describes
by reading that file and doing what an engine would:

- **base**: the Containerfile's ``ARG BASE`` (a ``python:3.11-slim-bookworm``
  pinned by digest), copied with ``skopeo`` into an OCI layout cached under
  ``/var/cache/weft/nodeimage/bases/`` so later builds are offline. Machines
  that cannot reach Docker Hub can build the same image on a base made from
  Debian bookworm's own packages (``--base debian-packages``: Python 3.11,
  dash and coreutils, downloaded with ``apt-get download``, which works
  wherever apt does). ``--base oci:DIR`` takes any OCI layout.
- **RUN**: the Containerfile's one RUN line, ``pip install --target
  /opt/weft/lib -r requirements.lock``, run on this host with pip's
  ``--platform`` options, so the wheels are the manylinux/cp311 ones the base's
  Python needs; wheels are cached under ``/var/cache/weft/nodeimage/wheels/``.
- **the ``hook`` stage**: its one file, ``hooks/weft_oci_hook.c``, compiled on
  this host with the flags its RUN line names (``hooks.native``: static, so
  the binary needs nothing of the base); ``COPY --from=hook`` takes it.
- **the ``init`` stage**: ``/usr/bin/tini-static`` from Debian's ``tini``
  package, which its RUN line installs, here unpacked from the package
  (``apt-get download``, the version apt resolves; cached under
  ``/var/cache/weft/nodeimage/debs/``); ``COPY --from=init`` takes it, and the
  ENTRYPOINT runs weft under it.
- **COPY, ENV, LABEL, USER, ENTRYPOINT, CMD**: applied as the Containerfile says
  (COPY honours ``nodeimage/containerignore``).

The added files become one uncompressed layer with fixed mtimes and owners,
sorted, so the same inputs give the same image digest. The output is an OCI
layout and ``weft-image.oci.tar`` (that layout as a tar, with the
``io.containerd.image.name`` annotation ``ctr images import`` uses)::

    python -m nodeimage.build --out DIR [--base debian-packages|oci:DIR|docker://REF] [--name REF]
    python -m nodeimage.build lock      # rewrite nodeimage/requirements.lock from the venv's versions
"""

from nodeimage.build.base import build_debian_base, debian_closure, fetch_registry_base, resolve_base
from nodeimage.build.common import (
    ARCHIVE_NAME,
    CACHE,
    CONTAINERFILE,
    DEFAULT_NAME,
    IGNOREFILE,
    LOCKFILE,
    REPO,
    BuildError,
)
from nodeimage.build.containerfile import Plan, ignore_patterns, parse_containerfile
from nodeimage.build.image import Built, build, image_config
from nodeimage.build.layer import pip_install, weft_layer
from nodeimage.build.layout import Layout
from nodeimage.build.lock import runtime_closure, write_lock

__all__ = ["ARCHIVE_NAME", "CACHE", "CONTAINERFILE", "DEFAULT_NAME", "IGNOREFILE", "LOCKFILE", "REPO", "BuildError",
           "Built", "Layout", "Plan", "build", "build_debian_base", "debian_closure", "fetch_registry_base",
           "ignore_patterns", "image_config", "parse_containerfile", "pip_install", "resolve_base",
           "runtime_closure", "weft_layer", "write_lock"]
