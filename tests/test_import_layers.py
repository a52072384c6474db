"""The import graph of ``ragstream``: a dependency-free core, no cycles between its parts, one layer order.

Built with grimp from the installed package, so a new import that runs up the layers fails here with
the chain that does it.
"""

from __future__ import annotations

import itertools
import sys

import grimp
import pytest

PACKAGE = "ragstream"

# What ``ragstream.core`` may import besides itself and the standard library.
CORE_THIRD_PARTY = frozenset({"numpy", "pydantic"})

# The layers of ``ragstream``, highest first: a module may import its own layer's modules only where
# the layer is not ``independent``, and any lower layer's, never a higher one's (directly or through
# other modules). Every top-level module of the package belongs to exactly one layer.
LAYERS: tuple[grimp.Layer, ...] = (
    grimp.Layer("cli"),
    grimp.Layer("embedded", "distributed", "service", "asyncapi"),
    grimp.Layer("api", "poison"),
    grimp.Layer("runtime"),
    grimp.Layer("knowledge"),
    grimp.Layer("pipeline"),
    grimp.Layer("control"),
    grimp.Layer("rechunk", "reindex"),
    grimp.Layer("jobs"),
    grimp.Layer("transport"),
    grimp.Layer("stages"),
    grimp.Layer("retrieval", "failures"),
    grimp.Layer("direct", "contextual", "chunking", "parsing_pool"),
    grimp.Layer("connectors", "chat"),
    grimp.Layer("embedding", "admission"),
    grimp.Layer("storage", "kafka"),
    grimp.Layer("credentials", "messages", "parsing", "vendor_http", "logs"),
    grimp.Layer("settings"),
    grimp.Layer("outbound", "metrics", "telemetry", "segmentation", "degradation", "faults", "local_kafka", "v1"),
    grimp.Layer("core"),
)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(PACKAGE, include_external_packages=True)


def _top_level(graph: grimp.ImportGraph) -> list[str]:
    """The subpackages and modules directly under ``ragstream``."""
    return sorted(graph.find_children(PACKAGE))


def _chain_text(chains: set[tuple[str, ...]]) -> str:
    return "; ".join(" -> ".join(chain) for chain in sorted(chains))


def test_core_imports_only_itself_the_standard_library_numpy_and_pydantic(graph: grimp.ImportGraph) -> None:
    core = f"{PACKAGE}.core"
    core_modules = {core, *graph.find_descendants(core)}
    allowed = set(sys.stdlib_module_names) | CORE_THIRD_PARTY
    imported = {
        (module, target)
        for module in core_modules
        for target in graph.find_modules_directly_imported_by(module)
        if target not in core_modules
    }
    assert imported, "the core imports at least numpy and pydantic"
    outside = sorted((module, target) for module, target in imported if target.split(".")[0] not in allowed)
    assert outside == []


def test_no_two_parts_of_the_package_import_each_other(graph: grimp.ImportGraph) -> None:
    cycles = {}
    for first, second in itertools.combinations(_top_level(graph), 2):
        there = graph.find_shortest_chains(first, second, as_packages=True)
        back = graph.find_shortest_chains(second, first, as_packages=True)
        if there and back:
            cycles[f"{first} <-> {second}"] = f"{_chain_text(there)} || {_chain_text(back)}"
    assert cycles == {}


def test_every_part_of_the_package_has_a_layer(graph: grimp.ImportGraph) -> None:
    layered = [f"{PACKAGE}.{tail}" for layer in LAYERS for tail in layer.module_tails]
    assert len(layered) == len(set(layered)), "a module is in two layers"
    assert sorted(layered) == _top_level(graph)


def _route_text(route: grimp.Route) -> str:
    return " -> ".join(("|".join(sorted(route.heads)), *route.middle, "|".join(sorted(route.tails))))


def test_no_import_runs_up_the_layers(graph: grimp.ImportGraph) -> None:
    illegal = graph.find_illegal_dependencies_for_layers(LAYERS, containers={PACKAGE})
    found = {
        f"{dependency.importer} -> {dependency.imported}": sorted(_route_text(route) for route in dependency.routes)
        for dependency in illegal
    }
    assert found == {}
