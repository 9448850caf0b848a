"""The docs stay true to the code: every job spec field is described in its section of docs/jobs.md,
and every relative link in the README and docs/ points at a file that exists."""
from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from ravnest.spec import JobSpec

ROOT = Path(__file__).resolve().parent.parent


def spec_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    names = []
    for name, field in model.model_fields.items():
        names.append(prefix + name)
        for inner in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                names += spec_fields(inner, f"{prefix}{name}.")
    return names


def test_every_job_spec_field_is_described_in_its_section_of_the_job_reference():
    text = (ROOT / "docs" / "jobs.md").read_text()
    sections = dict(re.findall(r"\*\*`(\w+)`\*\*(.*?)(?=\n\*\*`|\n## )", text, re.DOTALL))
    missing = []
    for path in spec_fields(JobSpec):
        top, _, rest = path.partition(".")
        if top not in sections:
            missing.append(top)
        elif rest and f"`{rest.rsplit('.', 1)[-1]}`" not in sections[top]:
            missing.append(path)
    assert not missing, f"docs/jobs.md does not describe {missing}"


def test_relative_links_in_the_readme_and_docs_point_at_files_that_exist():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples/jobs/README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+://", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_every_source_path_the_readme_and_docs_name_exists():
    """A module that moved or went away leaves no page pointing at it (`ravnest/pipeline/stage.py`,
    `coordinator/service/`, `tests/test_faults.py`; a `:line` or `::test` suffix is ignored)."""
    top = r"(?:ravnest|coordinator|node|bench|deploy|tests|protos|examples|docs)"
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path in re.findall(rf"`({top}/[\w./-]*\w/?)(?:[:][^`]*)?`", page.read_text()):
            if "*" not in path and not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)} names {path}")
    assert not missing, missing


def _quoted(text: str) -> set[str]:
    """The names `text` quotes: 'ring', `ring`, `"ring"`, and '' or `""` (raw)."""
    return {next(g for g in m.groups() if g is not None)
            for m in re.finditer(r"'([\w-]*)'|`\"([\w-]*)\"`|`([\w-]+)`", text)}


def test_the_specs_and_docs_lists_of_codecs_and_strategies_are_the_registries():
    """The registries are the only lists: wherever a page or a field's description names the choices,
    it names every built-in one, and only registered ones."""
    from ravnest.averaging.registry import AUTO, NO_AVERAGING, available_strategies
    from ravnest.spec import AveragingSettings, TrainingSettings
    from ravnest.wire import codecs

    fields = {"training.codec": (TrainingSettings.model_fields["codec"].description, codecs.names("pipeline")),
              "averaging.codec": (AveragingSettings.model_fields["codec"].description, codecs.names("averaging")),
              "averaging.strategy": (AveragingSettings.model_fields["strategy"].description,
                                     available_strategies())}
    sections = dict(re.findall(r"\*\*`(\w+)`\*\*(.*?)(?=\n\*\*`|\n## )", (ROOT / "docs/jobs.md").read_text(),
                               re.DOTALL))

    def bullet(section: str, field: str) -> str:
        return re.search(rf"- `{field}`: .*?\n(?=- `|\Z)", sections[section], re.DOTALL).group(0)
    table = "\n".join(line for line in (ROOT / "docs/links.md").read_text().split("\n## ")[0].splitlines()
                      if line.startswith("| `"))
    pages = {"docs/links.md (its table)": (table, codecs.names()),
             "docs/jobs.md (training.codec)": (bullet("training", "codec"), codecs.names("pipeline")),
             "docs/jobs.md (averaging.codec)": (bullet("averaging", "codec"), codecs.names("averaging")),
             "docs/averaging.md (strategies)": (re.search(r"Strategies today:.*?\n\n", (ROOT / "docs/averaging.md")
                                                          .read_text(), re.DOTALL).group(0),
                                                [s for s in available_strategies() if s not in (NO_AVERAGING, AUTO)])}
    wrong = []
    for where, (text, names) in {**fields, **pages}.items():
        named = _quoted(text)
        wrong += [f"{where} does not name {name!r}" for name in names if name not in named]
    assert not wrong, wrong
