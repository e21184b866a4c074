"""MkDocs hook: adds the generated pages (configuration reference, metrics glossary) to every build, so they
always match the code (arpo/reference/docs_gen.py)."""

from __future__ import annotations

from mkdocs.structure.files import File, Files


def on_files(files: Files, config) -> Files:
    from arpo.reference.docs_gen import GENERATED_PAGES

    for name, make in GENERATED_PAGES.items():
        existing = files.get_file_from_path(name)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, name, content=make()))
    return files
