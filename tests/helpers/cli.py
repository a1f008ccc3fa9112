"""Running the `autohet` CLI in-process and reading what it prints."""

from __future__ import annotations

from megatron_autohet.cli.main import main


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def table(out: str) -> list[dict[str, str]]:
    """Rows of a format_table output as header -> cell (columns split at the header's starts)."""
    lines = out.splitlines()
    header, rule = lines[0], lines[1]
    starts = [i for i, c in enumerate(rule) if c == "-" and (i == 0 or rule[i - 1] == " ")]
    bounds = list(zip(starts, starts[1:] + [None]))
    names = [header[a:b].strip() for a, b in bounds]
    return [{n: line[a:b].strip() for n, (a, b) in zip(names, bounds)} for line in lines[2:]]


def expect_usage_error(capsys, argv, message: str) -> None:
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    assert err.strip().splitlines() == [message]
    assert "Traceback" not in out + err
