"""The weft node image build (build.py), manifests, dashboards and rules."""
