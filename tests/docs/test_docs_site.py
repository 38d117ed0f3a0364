"""The documentation site (`mkdocs.yml` over docs/) builds with `mkdocs build --strict`, its API pages generated from
the docstrings, and the strict build fails on what it is there to catch: a broken link or anchor, a page left out
of the navigation, an API page naming something that does not exist.

Needs the `docs` extra (mkdocs, mkdocs-material, mkdocstrings[python]); skipped, saying so, where it is missing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # its parent package is absent
        return True


MISSING = [name for name in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python") if _absent(name)]
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"the docs extra is not installed ({', '.join(MISSING)} missing): pip install -e '.[docs]'"
)


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [
        sys.executable,
        "-m",
        "mkdocs",
        "build",
        "--strict",
        "--config-file",
        str(config),
        "--site-dir",
        str(site),
    ]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_the_site_builds_strictly_with_api_pages_from_the_docstrings(tmp_path):
    site = tmp_path / "site"
    done = build(REPO / "mkdocs.yml", site)
    assert done.returncode == 0, done.stderr[-3000:]
    pages = {
        "api/bridge/index.html": ["AutoBridge", "from_pretrained", "export_hf_weights", "load_hf_weights", "save_hf"],
        "api/engine/index.html": ["EngineConfig", "SamplingParams", "load_weights", "kv_cache_memory_bytes"],
        "api/grpo-config/index.html": ["GRPOConfig", "max_token_mult_prob_error", "megatron_cfg", "dtensor_cfg"],
    }
    for page, names in pages.items():
        html = (site / page).read_text()
        missing = [name for name in names if name not in html]
        assert not missing, f"{page} documents none of {missing}"
    # every page of docs/ is in the site (omitted ones fail the strict build, this shows they were rendered)
    for source in (REPO / "docs").rglob("*.md"):
        relative = source.relative_to(REPO / "docs").with_suffix("")
        target = site / ("index.html" if relative == Path("index") else relative / "index.html")
        assert target.is_file(), f"{source} was not rendered"


BROKEN = {
    "broken link": ({"index.md": "# Home\n\nSee [the page](gone.md).\n"}, ["index.md"], "gone.md"),
    "unknown anchor": ({"index.md": "# Home\n\nSee [below](#no-such-heading).\n"}, ["index.md"], "no-such-heading"),
    "page left out of the navigation": (
        {"index.md": "# Home\n", "orphan.md": "# Orphan\n"},
        ["index.md"],
        "orphan.md",
    ),
    "API name that does not exist": (
        {"index.md": "# Home\n\n::: hf_mcore_bridge.bridge.NoSuchBridge\n"},
        ["index.md"],
        "NoSuchBridge",
    ),
}


@pytest.mark.parametrize("pages, nav, expected", list(BROKEN.values()), ids=list(BROKEN))
def test_the_strict_build_fails_on_a_broken_page(tmp_path, pages, nav, expected):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in pages.items():
        (docs / name).write_text(text)
    # the project's own settings (theme, extensions, plugins, validation), over a docs directory of broken pages
    config = tmp_path / "mkdocs.yml"
    nav_lines = "".join(f"  - {name}\n" for name in nav)
    config.write_text(f"INHERIT: {REPO / 'mkdocs.yml'}\ndocs_dir: {docs}\nnav:\n{nav_lines}")
    done = build(config, tmp_path / "site")
    assert done.returncode != 0, done.stderr[-3000:]
    assert expected in done.stderr, done.stderr[-3000:]
