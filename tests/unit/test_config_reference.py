"""docs/configuration.md is generated from the config models and must never go stale or miss a key.

The checks run against the models themselves (every field of every model reachable from a section
must appear as a key), not only against the generator's own walk, so a walk that silently skips a
kind of field fails here too.
"""

from __future__ import annotations

import re
from pathlib import Path

from laminar import config_reference as ref

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_committed_page_is_the_generators_output() -> None:
    assert DOC.read_text() == ref.render(), (
        f"docs/configuration.md is stale: regenerate it with `{ref.REGENERATE}`"
    )


def test_check_flag_reports_a_stale_file(tmp_path: Path, capsys) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(ref.render().replace("| `cluster.name` |", "| `cluster.nam` |"))
    assert ref.main(["--check", str(stale)]) == 1
    err = capsys.readouterr().err
    assert "cluster.nam" in err and ref.REGENERATE in err
    assert ref.main(["--check", str(DOC)]) == 0


def test_every_field_of_every_model_appears() -> None:
    text = ref.render()
    keys = set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))
    segments = {part for key in keys for part in re.split(r"\.|\[\]\.?", key) if part}
    missing = []
    for section, model, _ in ref.sections():
        assert any(k.startswith(section + ".") for k in keys), f"section {section} has no keys"
        for m in ref.iter_models(model):
            for name, info in m.model_fields.items():
                if not info.exclude and name not in segments:
                    missing.append(f"{m.__name__}.{name}")
    assert not missing, f"fields missing from the reference: {missing}"


def test_every_role_section_is_documented() -> None:
    from laminar.roles_registry import builtin_roles

    documented = {name for name, _, _ in ref.sections()}
    assert {"cluster", "run", *builtin_roles()} <= documented
    text = ref.render()
    for name in documented:
        assert f"\n## {name}\n" in text


def test_union_variants_get_one_table_each() -> None:
    text = ref.render()
    assert "### `rollout.engine` (backend: vllm)" in text
    assert "### `rollout.engine` (backend: sim)" in text
    assert "### `rollout.engine.lengths` (kind: paper; in `rollout.engine` backend: sim)" in text


def test_constraints_and_defaults_are_rendered() -> None:
    text = ref.render()
    row = next(line for line in text.splitlines() if line.startswith("| `manager.repack.c_max` |"))
    assert "`0.99`" in row and "> 0" in row and "<= 1" in row
    row = next(line for line in text.splitlines() if line.startswith("| `data.prompts` |"))
    assert "**required**" in row
    row = next(line for line in text.splitlines() if line.startswith("| `cluster.log_format` |"))
    assert "one of `console`, `json`" in row


def test_every_field_has_a_description() -> None:
    missing = ref.missing_descriptions()
    assert not missing, (
        "config fields without a description (add `description=` to their Field): "
        + ", ".join(missing)
    )


def test_a_field_without_description_is_reported() -> None:
    from pydantic import BaseModel, Field

    class Inner(BaseModel):
        depth: int = 3

    class Probe(BaseModel):
        documented: int = Field(1, description="Has one.")
        bare: str = "x"
        inner: Inner = Field(default_factory=Inner)

    tables = ref.walk(Probe, "probe")
    assert ref.missing_descriptions(tables) == ["probe.bare", "probe.inner.depth"]


# -- docs/admin-api.md: generated from the admin server's route table -------------------------

ADMIN_DOC = DOC.parent / "admin-api.md"


def test_admin_page_is_the_generators_output() -> None:
    from laminar.roles.manager import openapi_doc

    assert ADMIN_DOC.read_text() == openapi_doc.render(), (
        f"docs/admin-api.md is stale: regenerate it with `{openapi_doc.REGENERATE}`"
    )


def test_admin_endpoint_table_matches_the_route_table() -> None:
    from laminar.roles.manager.openapi import ROUTES

    text = ADMIN_DOC.read_text()
    table = re.findall(r"^\| `([A-Z]+ [^`]+)` \| (token|open) \|", text, flags=re.M)
    assert table == [(f"{r.method} {r.path}", "token" if r.auth else "open") for r in ROUTES]
    for r in ROUTES:  # and each route has its own section with a curl example
        section = text.split(f"### `{r.method} {r.path}`\n", 1)[1].split("\n### ", 1)[0]
        assert "```bash\n" in section, f"{r.method} {r.path} has no example"


def test_admin_page_refuses_a_route_without_an_example(monkeypatch) -> None:
    import pytest

    from laminar.roles.manager import openapi_doc
    from laminar.roles.manager.openapi import Route

    extra = Route("GET", "/v1/new", "_new", "Something new", None)
    monkeypatch.setattr(openapi_doc, "ROUTES", (*openapi_doc.ROUTES, extra))
    with pytest.raises(ValueError, match="GET /v1/new"):
        openapi_doc.render()
