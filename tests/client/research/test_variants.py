"""A researcher's plan on disk: variants are copies of the code dir with the plan's files on top, and
nothing of a plan may write outside the research directory."""

from __future__ import annotations

from pathlib import Path

from agentjet_client.research.variants import outside_paths, write_round

ROOT = Path(__file__).resolve().parents[3]
DIGITS = ROOT / "examples" / "digits"


def test_a_variant_is_a_copy_of_the_code_dir_with_the_plans_files_and_the_original_is_untouched(tmp_path):
    before = (DIGITS / "agent.py").read_text()
    plan = {
        "variants": {"base": {"files": {}}, "v2": {"files": {"agent.py": "# new", "lib/extra.py": "X = 1"}}},
        "study": "x",
    }
    assert write_round(tmp_path, DIGITS, plan) == []
    assert (tmp_path / "variants" / "base" / "agent.py").read_text() == before
    assert (tmp_path / "variants" / "v2" / "agent.py").read_text() == "# new"
    assert (tmp_path / "variants" / "v2" / "lib" / "extra.py").read_text() == "X = 1"
    assert (tmp_path / "study.toml").read_text() == "x" and (DIGITS / "agent.py").read_text() == before


def test_a_plan_that_writes_outside_its_variant_or_names_a_bad_variant_is_refused(tmp_path):
    outside = tmp_path.parent / "escaped.py"
    plan = {
        "variants": {
            "v": {"files": {"../../escaped.py": "boom", "/etc/passwd2": "boom"}},
            "../up": {"files": {}},
            "w": {"files": "agent.py"},
        },
        "study": "",
    }
    problems = write_round(tmp_path / "round", DIGITS, plan)
    text = " ".join(problems)
    assert "'../../escaped.py' must be a relative path inside the code dir" in text and "'/etc/passwd2'" in text
    assert "variant name '../up'" in text and 'variant w: "files" must map' in text
    assert '"study" must be the study file as TOML text' in text
    assert not outside.exists() and not Path("/etc/passwd2").exists()
    assert write_round(tmp_path / "r2", DIGITS, {"study": "x"})[0].startswith('"variants" must be an object')


def test_study_paths_outside_the_research_directory_are_named_models_may_be_read_from_anywhere(tmp_path):
    out = tmp_path / "out"
    study = out / "rounds" / "r01" / "study.toml"
    study.parent.mkdir(parents=True)
    study.write_text(
        '[server]\nmodel = "/models/big"\nlog_to = "/tmp/tb"\n'
        '[client]\ncode_dir = "variants/base"\nargs = ["--spool-dir", "../../../spool"]\n'
        '[space]\n"client.code_dir" = ["variants/base", "~/elsewhere"]\n'
    )
    problems = outside_paths(study, out)
    assert len(problems) == 3, problems
    joined = " ".join(problems)
    assert (
        "server.log_to = '/tmp/tb'" in joined and "client.args = '../../../spool'" in joined and "~/elsewhere" in joined
    )
    assert "model" not in joined.replace("models", "")
