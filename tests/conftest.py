"""Shared test configuration: one deterministic hypothesis profile, loaded for every run."""

from __future__ import annotations

import pytest
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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist names the groups in the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep the tests of a module that share a module-scoped fixture (a kernel, a JupyterLab, a saved checkpoint) on
    one pytest-xdist worker (``make test`` runs ``--dist loadgroup``): the fixture starts once, and its tests run in
    the file's order, as they do without workers."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(fixture.scope == "module" for chain in defs for fixture in chain):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
