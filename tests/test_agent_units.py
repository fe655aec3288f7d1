import pytest

from edge_agent.agent import local_settings
from edgefl_protocol.errors import Rejected


def test_task_settings_are_read_with_defaults():
    s = local_settings({"lr": 0.1, "local_epochs": 3})
    assert (s.lr, s.epochs, s.batch_size) == (0.1, 3, 32)


@pytest.mark.parametrize("hp,message", [
    ({"batch_size": 0}, "batch_size"), ({"local_epochs": -1}, "local_epochs"), ({"lr": -0.1}, "lr"),
    ({"momentum": 1.0}, "momentum"), ({"lr": "fast"}, "must be a number"), ({"local_epochs": 10**6}, "local_epochs"),
])
def test_hostile_task_settings_are_rejected(hp, message):
    with pytest.raises(Rejected, match=message):
        local_settings(hp)
