"""MQTT topic names, in one place.

    edgefl/<fed>/model/<version>      retained: the manifest of that global model version
    edgefl/<fed>/model/<version>/<i>  retained: its i-th raw chunk (fetched only by devices that need it)
    edgefl/<fed>/model/<version>/delta/<version-1>  retained: the downlink delta to it (downlink = "delta")
    edgefl/<fed>/model/serving        retained: the manifest of the model devices serve ([serving])
    edgefl/<fed>/model/serving/<version>/<i>    retained: its chunks
    edgefl/<fed>/model/serving/delta/<version>  retained: the delta to it from the release before
    edgefl/<fed>/device/<id>/task     the device's work for a round
    edgefl/<fed>/device/<id>/update   the device's answer, or its refusal of the task (only it may write)
    edgefl/<fed>/device/<id>/receipt  the coordinator's verdict on each answer (the device resends until it has one)
    edgefl/<fed>/device/<id>/status   retained: online/offline and hardware profile
    edgefl/<fed>/device/<id>/enroll   the device's enrollment request (see `enrollment`)
    edgefl/<fed>/device/<id>/enrolled the coordinator's answer to it

A federation in sites adds, per site (see `site_partials`):

    edgefl/<fed>/site/<site>/task     coordinator -> site (queued for the bridge's session while it is down)
    edgefl/<fed>/site/<site>/status   site -> coordinator, retained: devices online and eligible
    edgefl/<fed>/site/<site>/partial  site -> coordinator: one per worker per round attempt
    edgefl/<fed>/site/<site>/cohort   site-local, retained: the devices the site tasked

The broker ACL (see broker_coordinator.access.broker) follows this layout with `%u`
patterns, so a device id is also its broker user name.
"""

from __future__ import annotations

import re

ROOT = "edgefl"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_name(kind: str, value: str) -> str:
    """Federation and device names become topic levels: no wildcards, no '/'."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"invalid {kind} name {value!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def model(fed: str, version: int) -> str:
    return f"{ROOT}/{fed}/model/{version}"


def models(fed: str) -> str:
    return f"{ROOT}/{fed}/model/+"


def model_chunk(fed: str, version: int, index: int) -> str:
    return f"{ROOT}/{fed}/model/{version}/{index}"


def model_chunks(fed: str, version: int) -> str:
    return f"{ROOT}/{fed}/model/{version}/+"


def serving(fed: str) -> str:
    """Retained: the manifest of the model the coordinator vouches for, for devices to serve. Under
    `model/` so that the devices' ACL (`model/#`) already lets them read it."""
    return f"{ROOT}/{fed}/model/serving"


def serving_chunk(fed: str, version: int, index: int) -> str:
    return f"{ROOT}/{fed}/model/serving/{version}/{index}"


def serving_chunks(fed: str, version: int) -> str:
    return f"{ROOT}/{fed}/model/serving/{version}/+"


def parse_serving_chunk_topic(topic: str) -> tuple[int, int] | None:
    """`edgefl/<fed>/model/serving/<version>/<i>` -> (version, i); None for anything else."""
    parts = topic.split("/")
    if (len(parts) != 6 or parts[0] != ROOT or parts[2:4] != ["model", "serving"]
            or not all(p.isascii() and p.isdigit() for p in parts[4:])):
        return None
    return int(parts[4]), int(parts[5])


def serving_delta(fed: str, version: int) -> str:
    """Retained: the delta from the serving release before it to serving release `version` (a device
    that holds that release fetches this instead of the chunks)."""
    return f"{ROOT}/{fed}/model/serving/delta/{version}"


def parse_serving_delta_topic(topic: str) -> int | None:
    """`edgefl/<fed>/model/serving/delta/<version>` -> version; None for anything else."""
    parts = topic.split("/")
    if (len(parts) != 6 or parts[0] != ROOT or parts[2:5] != ["model", "serving", "delta"]
            or not (parts[5].isascii() and parts[5].isdigit())):
        return None
    return int(parts[5])


def model_delta(fed: str, version: int) -> str:
    return f"{ROOT}/{fed}/model/{version}/delta/{version - 1}"


def parse_model_delta_topic(topic: str) -> int | None:
    """`edgefl/<fed>/model/<v>/delta/<v-1>` -> v; None for anything else."""
    parts = topic.split("/")
    if (len(parts) != 6 or parts[0] != ROOT or parts[2] != "model" or parts[4] != "delta"
            or not all(p.isascii() and p.isdigit() for p in (parts[3], parts[5]))
            or int(parts[5]) != int(parts[3]) - 1):
        return None
    return int(parts[3])


def task(fed: str, device: str) -> str:
    return f"{ROOT}/{fed}/device/{device}/task"


def update(fed: str, device: str) -> str:
    return f"{ROOT}/{fed}/device/{device}/update"


def receipt(fed: str, device: str) -> str:
    return f"{ROOT}/{fed}/device/{device}/receipt"


def status(fed: str, device: str) -> str:
    return f"{ROOT}/{fed}/device/{device}/status"


def enroll(fed: str, device: str) -> str:
    return f"{ROOT}/{fed}/device/{device}/enroll"


def enrolled(fed: str, device: str) -> str:
    return f"{ROOT}/{fed}/device/{device}/enrolled"


def all_enrolls(fed: str) -> str:
    return f"{ROOT}/{fed}/device/+/enroll"


def all_updates(fed: str) -> str:
    return f"{ROOT}/{fed}/device/+/update"


def all_statuses(fed: str) -> str:
    return f"{ROOT}/{fed}/device/+/status"


def parse_device_topic(topic: str) -> tuple[str, str, str] | None:
    """`edgefl/<fed>/device/<id>/<kind>` -> (fed, id, kind); None for anything else."""
    parts = topic.split("/")
    if len(parts) != 5 or parts[0] != ROOT or parts[2] != "device":
        return None
    return parts[1], parts[3], parts[4]


def site_topic(fed: str, site: str, kind: str) -> str:
    return f"{ROOT}/{fed}/site/{site}/{kind}"


def all_site_topics(fed: str, kind: str) -> str:
    return f"{ROOT}/{fed}/site/+/{kind}"


def parse_site_topic(topic: str) -> tuple[str, str, str] | None:
    """`edgefl/<fed>/site/<site>/<kind>` -> (fed, site, kind); None for anything else."""
    parts = topic.split("/")
    if len(parts) != 5 or parts[0] != ROOT or parts[2] != "site":
        return None
    return parts[1], parts[3], parts[4]


def parse_model_topic(topic: str) -> int | None:
    parts = topic.split("/")
    if len(parts) != 4 or parts[0] != ROOT or parts[2] != "model" or not parts[3].isdigit():
        return None
    return int(parts[3])


def parse_model_chunk_topic(topic: str) -> tuple[int, int] | None:
    """`edgefl/<fed>/model/<version>/<i>` -> (version, i); None for anything else."""
    parts = topic.split("/")
    if (len(parts) != 5 or parts[0] != ROOT or parts[2] != "model"
            or not all(p.isascii() and p.isdigit() for p in parts[3:])):
        return None
    return int(parts[3]), int(parts[4])
