"""The volunteer's settings: what this machine gives to the swarm, and when.

One TOML file per user (``settings_path()`` in ``peer.identity_store`` says where), read by
the node at start and rewritten by the dashboard and by ``UpdateSettings`` on the control
socket. Every value is validated here (strict keys, types, ranges); a bad file is refused
with one line that names the key and what to do, and is never overwritten by a partial write
(``peer.settings_store`` writes atomically).

    [compute]
    device = "auto"              # auto, cpu, cuda, cuda:N, mps; applies at the next start or resume
    gpu_memory_fraction = 1.0    # cap on this process's share of the GPU's memory (CUDA only)
    max_batch_size = 0           # cap on sequences per forward pass (0: the run's batch size);
                                 # the run's batch is split into micro-batches, the math is the same
    cpu_threads = 0              # torch threads on CPU (0: torch's default)
    duty_cycle = 1.0             # share of the time spent training (0.05-1): below 1 the node
                                 # rests after each inner step (0.5: as long as the step took)
    gpus = 1                     # processes to train on, one per GPU (torch.distributed; at start)

    [network]
    max_upload_mbps = 0.0        # caps on the averaging streams, megabits per second (0: none)
    max_download_mbps = 0.0

    [schedule]
    only_when_idle = false       # pause while someone uses the machine (where the OS tells)
    only_on_ac_power = false     # pause on battery (where the OS tells)
    window = ""                  # "HH:MM-HH:MM" local time, e.g. "22:00-07:00"; "" = any time

    [client]
    confirmed = false            # the volunteer agreed to contribute; until then the dashboard
                                 # starts nodes paused and explains what will happen

    [metrics]
    port = 0                     # a Prometheus endpoint at http://address:port/metrics (0: none);
    address = "127.0.0.1"        # applies at the next start (peer.metrics lists what it serves)

Sans-IO: parsing takes text, rendering returns text.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from dataclasses import dataclass, field

from protocol.config import _check, from_dict, to_dict
from protocol.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ClientSettings", "ComputeSettings", "MetricsSettings", "NetworkSettings", "ScheduleSettings", "Settings", "in_window",
           "parse_settings", "parse_window", "render_settings"]

_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d{1,2})?")
_WINDOW = re.compile(r"([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-3]):([0-5]\d)")
_ADDRESS = re.compile(r"[0-9]{1,3}(\.[0-9]{1,3}){3}|[0-9a-fA-F:]{2,39}|localhost")  # IPv4, IPv6, localhost


def parse_window(text: str) -> tuple[int, int] | None:
    """``"22:00-07:00"`` -> (start, end) in minutes after midnight; ``""`` -> None (any time)."""
    if text == "":
        return None
    m = _WINDOW.fullmatch(text)
    _check(m is not None, f"schedule.window must look like \"22:00-07:00\" (24-hour local time) or \"\", got {text!r}")
    assert m is not None
    a, b = int(m[1]) * 60 + int(m[2]), int(m[3]) * 60 + int(m[4])
    _check(a != b, f"schedule.window {text!r} starts and ends at the same time; use \"\" for any time")
    return a, b


def in_window(window: tuple[int, int] | None, minute_of_day: int) -> bool:
    """Whether ``minute_of_day`` (0..1439, local time) is inside the window; windows may wrap
    midnight ("22:00-07:00")."""
    if window is None:
        return True
    a, b = window
    return a <= minute_of_day < b if a < b else minute_of_day >= a or minute_of_day < b


@dataclass(kw_only=True, slots=True)
class ComputeSettings:
    device: str = "auto"
    gpu_memory_fraction: float = 1.0
    max_batch_size: int = 0
    cpu_threads: int = 0
    duty_cycle: float = 1.0
    gpus: int = 1

    def __post_init__(self) -> None:
        _check(isinstance(self.device, str) and _DEVICE.fullmatch(self.device) is not None,
               f"compute.device must be auto, cpu, mps, cuda or cuda:N, got {self.device!r}")
        _check(0.05 <= self.gpu_memory_fraction <= 1.0,
               f"compute.gpu_memory_fraction must be in [0.05, 1.0], got {self.gpu_memory_fraction}")
        _check(0 <= self.max_batch_size <= 65536, f"compute.max_batch_size must be in [0, 65536], got {self.max_batch_size}")
        _check(0 <= self.cpu_threads <= 1024, f"compute.cpu_threads must be in [0, 1024], got {self.cpu_threads}")
        _check(0.05 <= self.duty_cycle <= 1.0,
               f"compute.duty_cycle must be in [0.05, 1.0], got {self.duty_cycle}")
        _check(isinstance(self.gpus, int) and not isinstance(self.gpus, bool) and 1 <= self.gpus <= 64,
               f"compute.gpus must be an integer in [1, 64], got {self.gpus!r}")


@dataclass(kw_only=True, slots=True)
class NetworkSettings:
    max_upload_mbps: float = 0.0
    max_download_mbps: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_upload_mbps", "max_download_mbps"):
            v = getattr(self, name)
            _check(0.0 <= v <= 1e6, f"network.{name} must be in [0, 1000000] megabits per second (0: no cap), got {v}")


@dataclass(kw_only=True, slots=True)
class ScheduleSettings:
    only_when_idle: bool = False
    only_on_ac_power: bool = False
    window: str = ""

    def __post_init__(self) -> None:
        parse_window(self.window)


@dataclass(kw_only=True, slots=True)
class ClientSettings:
    confirmed: bool = False


@dataclass(kw_only=True, slots=True)
class MetricsSettings:
    port: int = 0
    address: str = "127.0.0.1"

    def __post_init__(self) -> None:
        _check(self.port == 0 or 1024 <= self.port <= 65535,
               f"metrics.port must be 0 (no endpoint) or in [1024, 65535], got {self.port}")
        _check(isinstance(self.address, str) and _ADDRESS.fullmatch(self.address) is not None,
               f"metrics.address must be an IP address such as 127.0.0.1 or 0.0.0.0, got {self.address!r}")


@dataclass(kw_only=True, slots=True)
class Settings:
    compute: ComputeSettings = field(default_factory=ComputeSettings)
    network: NetworkSettings = field(default_factory=NetworkSettings)
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    client: ClientSettings = field(default_factory=ClientSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)

    def replace(self, **changes: typing.Any) -> Settings:
        """A copy with ``section_key=value`` changes (``network_max_upload_mbps=10``), validated."""
        data = to_dict(self)
        for name, value in changes.items():
            section, _, key = name.partition("_")
            _check(section in data and key in data[section], f"unknown setting {name!r}")
            data[section][key] = value
        return from_dict(Settings, data)


def parse_settings(text: str, where: str = "settings") -> Settings:
    """Parse and validate a settings file's text; missing keys take their defaults."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where} is not valid TOML ({e}); fix it or delete it to start from the defaults") from None
    try:
        return from_dict(Settings, data)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _toml_value(v: typing.Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v)
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_settings(s: Settings) -> str:
    """The TOML text of ``s`` (every key, so the file documents what can be set)."""
    lines = ["# swarmstream settings: edit here or in the dashboard (Settings screen).",
             "# What each key does: docs/SETTINGS.md."]
    for section in dataclasses.fields(s):
        lines += ["", f"[{section.name}]"]
        sub = getattr(s, section.name)
        for f in dataclasses.fields(sub):
            lines.append(f"{f.name} = {_toml_value(getattr(sub, f.name))}")
    return "\n".join(lines) + "\n"
