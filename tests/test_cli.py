"""The top-level `jdp` command."""
import pytest

import jdp
from jdp.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"jdp {jdp.__version__}"
