"""What is API: the names of the ``__all__`` of every public module of ``lightning_ext``.

A public module is one without a ``_``-prefixed part in its dotted name (``lightning_ext.kernels.cpu``,
not ``lightning_ext.kernels._triton``), as for the API reference (``docs/_ext/api_coverage.py``).
Every public module declares ``__all__``; every name in it is public (no leading underscore) and is
importable from the module's package, whose ``__init__`` re-exports it in its own ``__all__``; every
function or class a public module defines at top level is in its ``__all__`` or ``_``-prefixed.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import pytest

import lightning_ext


def _public_modules() -> list[ModuleType]:
    modules = [lightning_ext]
    for info in pkgutil.walk_packages(lightning_ext.__path__, "lightning_ext."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            modules.append(importlib.import_module(info.name))
    return modules


MODULES = _public_modules()


def _package_of(module: ModuleType) -> ModuleType:
    """The module itself for a package, else the package that contains it."""
    if hasattr(module, "__path__"):
        return module
    return importlib.import_module(module.__name__.rpartition(".")[0])


def test_the_walk_finds_every_public_module() -> None:
    names = {m.__name__ for m in MODULES}
    assert {
        "lightning_ext.stats.reporting",
        "lightning_ext.kernels.registry",
        "lightning_ext.nn.sync_batch_norm",
    } <= names
    assert not any(name.split(".")[-1].startswith("_") for name in names)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_all_names_are_public_and_exported_by_the_package(module: ModuleType) -> None:
    assert hasattr(module, "__all__"), f"{module.__name__} declares no __all__"
    assert len(set(module.__all__)) == len(module.__all__), f"{module.__name__}.__all__ repeats a name"
    private = [name for name in module.__all__ if name.startswith("_") and name != "__version__"]
    assert not private, f"{module.__name__}.__all__ lists private names {private}"
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{module.__name__}.__all__ lists names it does not define: {missing}"
    package = _package_of(module)
    if package is module:
        return
    not_exported = [
        name
        for name in module.__all__
        if getattr(package, name, None) is not getattr(module, name) or name not in package.__all__
    ]
    assert not not_exported, (
        f"{module.__name__}.__all__ names {not_exported}, which {package.__name__} does not re-export in "
        "its __all__: export them from the package (public) or prefix them with '_' (private)"
    )


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_public_definition_is_in_all(module: ModuleType) -> None:
    defined = [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == module.__name__
    ]
    outside = sorted(set(defined) - set(module.__all__))
    assert not outside, (
        f"{module.__name__} defines public {outside} outside its __all__: add them to __all__ (and the "
        "package's) or prefix them with '_'"
    )


def test_packages_reexport_only_public_names_of_their_modules() -> None:
    """A package's ``__all__`` lists subpackages and names that the module defining them lists too."""
    for package in (m for m in MODULES if hasattr(m, "__path__")):
        for name in package.__all__:
            obj = getattr(package, name)
            home = getattr(obj, "__module__", None)  # None for constants: their module is not known
            if isinstance(obj, ModuleType) or home is None:
                continue
            assert name in importlib.import_module(home).__all__, (
                f"{package.__name__} re-exports {name} from {home}, whose __all__ does not list it"
            )


def test_no_name_is_exported_by_two_packages() -> None:
    # One place per name: a re-export by another package is a second spelling of the same API.
    owners: dict[str, list[str]] = {}
    for package in (m for m in MODULES if hasattr(m, "__path__")):
        for name in package.__all__:
            owners.setdefault(name, []).append(package.__name__)
    assert {name: where for name, where in owners.items() if len(where) > 1} == {}
