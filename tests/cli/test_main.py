"""The ``devicekit`` group itself: unknown subcommands."""

from __future__ import annotations

import pytest

from devicekit.cli.main import main


def run_cli(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_typo_suggests_the_close_command(capsys):
    code, out, err = run_cli(capsys, "stauts")
    assert (code, out) == (1, "")
    assert err.startswith("devicekit: no such command 'stauts'; did you mean 'status'?")
    assert len(err.splitlines()) == 1


def test_unrelated_name_gets_no_suggestion(capsys):
    code, _, err = run_cli(capsys, "xyzzy")
    assert code == 1
    assert "no such command 'xyzzy'" in err and "did you mean" not in err
