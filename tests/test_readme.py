"""README.md's measured figures are its artifacts': `benchmarks/readme_table.py --check` passes, and fails on a figure
that differs from its artifact or a block that is missing."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import readme_table  # noqa: E402


def test_every_results_block_of_the_readme_equals_its_artifact():
    assert readme_table.main(["--check"]) == 0


def test_the_check_fails_on_a_changed_figure_and_a_missing_block(tmp_path, monkeypatch):
    text = readme_table.README.read_text()
    body = readme_table.GENERATORS["budget"]()
    assert body in text
    changed = tmp_path / "README.md"
    changed.write_text(text.replace(body, body.replace("0.80", "0.78", 1)))  # 3ml base's FLOP ratio, misquoted
    monkeypatch.setattr(readme_table, "README", changed)
    assert readme_table.main(["--check"]) == 1
    assert readme_table.render(changed.read_text())[1] == ["budget"]
    changed.write_text(text.replace("<!-- results: budget -->", "<!-- budget -->"))
    assert readme_table.main(["--check"]) == 1
    changed.write_text(text.replace("<!-- results: budget -->", "<!-- results: budgets -->"))
    with pytest.raises(ValueError, match="unknown results block 'budgets'"):
        readme_table.main(["--check"])
