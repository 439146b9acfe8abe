"""weft's OCI hook (``weft-oci-hook``), run by runc; standard library only."""
