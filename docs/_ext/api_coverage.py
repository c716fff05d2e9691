"""Sphinx extension: fail the build when a public name of lightning_ext has no API reference entry.

The public names are those of every ``__all__`` of every public module (no ``_``-prefixed part) of
the package. A name listed by a package's own ``__init__`` (``lightning_ext.stats.report``) needs an
entry under exactly that path; a name listed by a submodule (``lightning_ext.stats.reporting.report``)
may instead be documented under an enclosing package that re-exports the same object. Submodules
named in ``__all__`` (``lightning_ext.amp``) need a module entry.

:func:`missing_entries` is shared with ``tests/docs/test_docs.py``, which checks the built
``objects.inv`` the same way.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

PACKAGE = "lightning_ext"


@dataclass(frozen=True)
class PublicName:
    """One name of one ``__all__``: the targets any of which documents it, and their kind."""

    module: str  # the module whose __all__ lists it
    name: str
    targets: tuple[str, ...]  # acceptable fully qualified reference targets, preferred first
    is_module: bool


def public_modules(package: str = PACKAGE) -> Iterator[ModuleType]:
    """The package and every submodule without a ``_``-prefixed part, imported."""
    root = importlib.import_module(package)
    yield root
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        yield importlib.import_module(info.name)


def public_names(package: str = PACKAGE) -> list[PublicName]:
    """Every name of every ``__all__`` of the package's public modules."""
    names = []
    for module in public_modules(package):
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if isinstance(obj, ModuleType):
                names.append(PublicName(module.__name__, name, (obj.__name__,), True))
                continue
            targets = [f"{module.__name__}.{name}"]
            if not _is_package(module):  # a submodule's name may be documented where it is re-exported
                parts = module.__name__.split(".")
                for i in range(len(parts) - 1, 0, -1):
                    parent = importlib.import_module(".".join(parts[:i]))
                    if getattr(parent, name, None) is obj:
                        targets.insert(0, f"{parent.__name__}.{name}")
                        break
            names.append(PublicName(module.__name__, name, tuple(targets), False))
    return names


def _is_package(module: ModuleType) -> bool:
    return hasattr(module, "__path__")


def missing_entries(objects: Iterable[str], modules: Iterable[str]) -> list[PublicName]:
    """The public names that have no entry among the documented ``objects`` and ``modules``."""
    objects, modules = set(objects), set(modules)
    return [
        n
        for n in public_names()
        if not (n.targets[0] in modules if n.is_module else any(t in objects for t in n.targets))
    ]


def _check(app: Any, env: Any) -> None:
    from sphinx.util import logging

    logger = logging.getLogger(__name__)
    domain = env.get_domain("py")
    for entry in missing_entries(domain.objects, domain.modules):
        logger.warning(
            "public name %s.%s (in its __all__) has no API reference entry; document it as %s in docs/api/",
            entry.module,
            entry.name,
            " or ".join(entry.targets),
            type="lightning_ext",
            subtype="api_coverage",
        )


def setup(app: Any) -> dict[str, Any]:
    app.connect("env-check-consistency", _check)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
