"""Settings shared by the unit tests."""

from hypothesis import settings

# No per-example deadline: the tests assert behaviour, never speed (benchmarks in bench/ measure that), and on a
# machine busy with the integration suite beside them a slow example is not a failure.
settings.register_profile("weft", deadline=None)
settings.load_profile("weft")
