"""The route table: every verb module is routed under its own path, and every path is a CRI method weft knows."""

from __future__ import annotations

import importlib
import pkgutil

import shim.cri.verbs
from shim.cri import methods
from shim.cri.route import Route
from shim.cri.verbs import routes

SHARED = {"admin", "listing", "remote_calls", "routes", "wire"}  # modules that are not one CRI verb


def verb_modules():
    for info in pkgutil.iter_modules(shim.cri.verbs.__path__):
        if info.name not in SHARED:
            yield importlib.import_module(f"shim.cri.verbs.{info.name}")


def test_every_verb_module_is_routed_under_its_own_path(fabric) -> None:
    table = routes.intercepted(fabric)
    paths = {m.PATH for m in verb_modules()}
    assert set(table) == paths
    assert len(paths) == len(list(verb_modules())), "no two modules claim one path"
    assert all(isinstance(r, Route) for r in table.values())


def test_every_intercepted_path_is_a_cri_method_answered_in_its_own_shape(fabric) -> None:
    """A unary method gets a unary handler; a server-streaming one a stream handler, and nothing else."""
    for path, route in routes.intercepted(fabric).items():
        method = methods.KNOWN[path]
        if method.shape is methods.Shape.SERVER_STREAM:
            assert route.stream is not None and route.handle is None, path
        else:
            assert method.shape is methods.Shape.UNARY and route.handle is not None and route.stream is None, path


def test_the_agents_table_is_the_verbs_and_the_admin_calls(fabric) -> None:
    assert routes.table(fabric).keys() == routes.intercepted(fabric).keys() | routes.admin_calls(fabric).keys()


def test_on_a_plain_node_only_the_four_opt_in_and_removal_verbs_are_intercepted(fabric) -> None:
    """No mesh, no shadows, no remote containers: every other verb is pure pass-through."""
    live = {path.rsplit("/", 1)[1] for path, r in routes.intercepted(fabric).items() if r.applies()}
    assert live == {"RunPodSandbox", "CreateContainer", "RemoveContainer", "RemovePodSandbox"}
