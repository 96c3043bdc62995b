"""mkdocs.yml as data, for tests that check the site's navigation against its pages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MKDOCS_YML = Path(__file__).resolve().parents[1] / "mkdocs.yml"


def load_mkdocs_config() -> dict[str, Any]:
    """The parsed mkdocs.yml; a ``!!python/name`` tag (a function the site names) reads as None."""

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config: dict[str, Any] = yaml.load(MKDOCS_YML.read_text(encoding="utf-8"), Loader=_Loader)
    return config


def nav_pages(nav: object) -> list[tuple[str | None, str]]:
    """(title, page path) of every page in a nav, in order; a page listed without a title has None."""
    found: list[tuple[str | None, str]] = []
    for entry in nav if isinstance(nav, list) else [nav]:
        if isinstance(entry, str):
            found.append((None, entry))
        elif isinstance(entry, dict):
            for title, target in entry.items():
                found += [(title, target)] if isinstance(target, str) else nav_pages(target)
    return found
