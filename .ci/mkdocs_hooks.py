"""MkDocs hook: the benchmark pages show the plots committed under benchmarks/results/, which lie
outside docs/. Each page links them by their path in the repository (`../../benchmarks/results/
...png`, right on GitHub too); this adds those images to the site under `results/` so the links
resolve there as well, and `mkdocs build --strict` still fails on any other broken link."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def on_files(files: Files, config) -> Files:
    for image in sorted(RESULTS.rglob("*.png")):
        relative = image.relative_to(RESULTS).as_posix()
        files.append(
            File(
                f"../benchmarks/results/{relative}",
                config["docs_dir"],
                config["site_dir"],
                config["use_directory_urls"],
                dest_uri=f"results/{relative}",
                inclusion=InclusionLevel.INCLUDED,
            )
        )
    return files
