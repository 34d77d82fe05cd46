"""Set-up errors are the user's (exit 2, no traceback); the same exception types after set-up are not."""

import pytest

from flowalign.config import ConfigError
from flowalign.errors import SetupError, setup_phase


def test_setup_phase_turns_input_errors_into_setup_errors_and_keeps_the_cause():
    for error in (ValueError("bad value"), FileNotFoundError("no such file: x"), NotADirectoryError("x is a file")):
        with pytest.raises(SetupError, match=str(error)) as raised:
            with setup_phase():
                raise error
        assert raised.value.__cause__ is error and isinstance(raised.value, ValueError)
    with pytest.raises(RuntimeError):  # not an input error: left as it is
        with setup_phase():
            raise RuntimeError("a bug")
    config_error = ConfigError("optim.lr must be > 0", key="optim.lr")
    with pytest.raises(ConfigError) as raised:  # already a SetupError: passes through unchanged
        with setup_phase():
            raise config_error
    assert raised.value is config_error and raised.value.key == "optim.lr"

