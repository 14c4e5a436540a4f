"""Shared test configuration: one deterministic hypothesis profile, loaded for every run."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# derandomize: the same examples on every machine and every run (a failure always reproduces);
# deadline=None: timing noise on a loaded 2-core CI box must not fail a property.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=200,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("ci")
