"""The docs' quoted command outputs stay true (testing/doc_outputs.py): the checker on small
documents of its own (bash's echo as the command), then on README.md and docs/*.md, whose fast
commands it runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_autohet.testing.doc_outputs import REPO, check, documents, main, parse

COMMAND = "```bash\necho 'plan: 4 pipelines, $0.02567'; echo 'searched in 1.3 s'\n```\n\n"


def doc(tmp_path: Path, text: str) -> tuple[Path, list[str]]:
    path = tmp_path / "page.md"
    path.write_text(text)
    return path, check(parse(path))


@pytest.mark.unit
def test_a_quoted_output_equal_but_for_its_marked_variable_field_passes(tmp_path):
    _, problems = doc(tmp_path, COMMAND + '<!-- output-of-above variable="searched in * s" -->\n'
                      "```\nplan: 4 pipelines, $0.02567\nsearched in 4.6 s\n```\n")
    assert problems == []


@pytest.mark.unit
def test_a_changed_figure_is_drift_and_write_puts_todays_output(tmp_path):
    path, problems = doc(tmp_path, COMMAND + '<!-- output-of-above variable="searched in * s" '
                         "-->\n```\nplan: 4 pipelines, $0.02094\nsearched in 4.6 s\n```\n")
    assert len(problems) == 1 and problems[0].startswith("page.md:6: the quoted output differs")
    assert "-plan: 4 pipelines, $0.02094\n+plan: 4 pipelines, $0.02567" in problems[0]
    assert main([str(path), "--write"]) == 1
    assert main([str(path)]) == 0
    assert "```\nplan: 4 pipelines, $0.02567\nsearched in " in path.read_text()


@pytest.mark.unit
def test_a_variable_field_not_marked_is_drift(tmp_path):
    _, problems = doc(tmp_path, COMMAND + "<!-- output-of-above -->\n"
                      "```\nplan: 4 pipelines, $0.02567\nsearched in 4.6 s\n```\n")
    assert len(problems) == 1 and "-searched in 4.6 s\n+searched in 1.3 s" in problems[0]


@pytest.mark.unit
def test_figures_quoted_in_prose_must_be_todays(tmp_path):
    block = (COMMAND + '<!-- output-of-above name=quick variable="searched in * s" -->\n'
             "```\nplan: 4 pipelines, $0.02567\nsearched in 4.6 s\n```\n\n")
    _, problems = doc(tmp_path, block + '<!-- figures-from quick="$0.02567" -->\n'
                      "The plan costs\n$0.02567 per million tokens.\n")
    assert problems == []
    _, problems = doc(tmp_path, block + '<!-- figures-from quick="$0.02094" -->\n'
                      "The plan costs $0.02094 per million tokens.\n")
    assert problems == ["page.md:11: '$0.02094' is no longer in 'quick''s output (the paragraph "
                        "and the comment need today's figure)"]
    _, problems = doc(tmp_path, block + '<!-- figures-from quick="$0.02567" -->\n'
                      "The plan costs $0.02094 per million tokens.\n")
    assert problems == ["page.md:11: '$0.02567' is not in the paragraph below the comment"]


@pytest.mark.unit
def test_every_quoted_output_says_what_it_is(tmp_path):
    _, problems = doc(tmp_path, "```\nsome output\n```\n\n"
                      '<!-- measured date=2026-11-27 load="3 on 2 cores" -->\n```\nran\n```\n\n'
                      "<!-- measured -->\n```\nran\n```\n\n"
                      "<!-- illustration -->\n```json\n{}\n```\n\n```text\na tree\n```\n\n"
                      "<!-- output-of-above -->\n```\nno command above\n```\n")
    assert problems == [
        "page.md:1: a quoted output with no <!-- output-of-above -->, <!-- measured --> or "
        "<!-- illustration --> comment above it",
        "page.md:10: measured needs date=YYYY-MM-DD and load=...",
        "page.md:24: output-of-above needs the ```bash block of the command right above it"]


@pytest.mark.unit
def test_an_output_in_a_list_item_with_its_command_in_the_comment(tmp_path):
    path, problems = doc(tmp_path, "1. the plan:\n\n   <!-- output-of command=\"echo 'plan: 5 "
                         "stages'\" -->\n   ```\n   plan: 4 stages\n   ```\n")
    assert len(problems) == 1 and "-plan: 4 stages\n+plan: 5 stages" in problems[0]
    assert main([str(path), "--write"]) == 1
    assert path.read_text().endswith("   ```\n   plan: 5 stages\n   ```\n")
    assert main([str(path)]) == 0


@pytest.mark.unit
def test_a_failing_command_is_reported_with_its_status(tmp_path):
    _, problems = doc(tmp_path, "```bash\necho half; exit 3\n```\n\n<!-- output-of-above -->\n"
                      "```\nhalf\n```\n")
    assert problems == ["page.md:6: the command above exited with status 3:\nhalf"]


@pytest.mark.integration
def test_the_docs_quote_what_their_commands_print_today():
    """README.md and docs/*.md: every quoted output marked, the fast commands' outputs (autohet
    plan, compare, replan on the bundled configs) and the figures the prose takes from them as
    the commands print them now. To fix drift: python -m megatron_autohet.testing.doc_outputs
    --write, then reword the prose the check names."""
    problems = []
    for path in documents():
        problems += check(parse(path))
    assert not problems, "\n".join(problems)
    assert len([b for p in documents() for b in parse(p).blocks]) >= 4
    assert documents()[0] == REPO / "README.md"
