"""The volunteer's settings file, the credit ledger, the bandwidth caps and the run conditions."""

import json

import pytest

from peer.conditions import IDLE_AFTER_S, on_mains_power, pause_reason
from peer.credit import CreditLedger
from peer.ratelimit import RateLimiter
from peer.settings_store import load_settings, save_settings
from protocol.errors import ConfigError
from protocol.settings import ScheduleSettings, Settings, in_window, parse_settings, parse_window, render_settings


def test_settings_round_trip_and_missing_keys_take_defaults():
    s = Settings().replace(network_max_upload_mbps=12.5, schedule_window="22:00-07:00", client_confirmed=True)
    assert parse_settings(render_settings(s)) == s
    assert parse_settings("[network]\nmax_download_mbps = 3\n").network.max_download_mbps == 3.0


@pytest.mark.parametrize("text, says", [
    ('[compute]\ndevice = "gpu"\n', "compute.device"),
    ("[compute]\ngpu_memory_fraction = 2\n", "gpu_memory_fraction"),
    ("[network]\nmax_upload_mbps = -1\n", "max_upload_mbps"),
    ('[schedule]\nwindow = "9-5"\n', "22:00-07:00"),
    ("[schedule]\nonly_when_idle = 1\n", "only_when_idle"),
    ("[extra]\nx = 1\n", "unknown key"),
    ("[metrics]\nport = 80\n", "metrics.port must be 0"),
    ('[metrics]\nport = "9100"\n', "metrics.port"),
    ('[metrics]\naddress = "example.com; rm"\n', "metrics.address"),
    ("[network\n", "not valid TOML"),
])
def test_bad_settings_are_refused_with_the_key_and_what_to_do(text, says):
    with pytest.raises(ConfigError, match=says):
        parse_settings(text, where="settings.toml")


def test_a_bad_settings_file_is_never_overwritten(tmp_path):
    path = tmp_path / "settings.toml"
    assert load_settings(path) == Settings() and path.exists()  # first start writes the defaults
    path.write_text('[compute]\ndevice = "gpu"\n')
    with pytest.raises(ConfigError):
        load_settings(path)
    assert path.read_text() == '[compute]\ndevice = "gpu"\n'
    save_settings(path, Settings().replace(compute_cpu_threads=4))
    assert load_settings(path).compute.cpu_threads == 4
    assert not list(tmp_path.glob("*.tmp"))


def test_windows_may_wrap_midnight():
    w = parse_window("22:00-07:00")
    assert in_window(w, 23 * 60) and in_window(w, 6 * 60 + 59) and not in_window(w, 7 * 60)
    assert in_window(parse_window("09:00-17:30"), 17 * 60 + 29) and not in_window(parse_window("09:00-17:30"), 8 * 60)
    assert in_window(None, 0)


def test_pause_reasons_follow_the_settings_and_unknown_readings_never_pause():
    s = ScheduleSettings(only_when_idle=True, only_on_ac_power=True, window="08:00-20:00")
    assert pause_reason(s, 7 * 60, True, IDLE_AFTER_S) == "outside your schedule (08:00-20:00)"
    assert pause_reason(s, 9 * 60, False, IDLE_AFTER_S) == "on battery"
    assert pause_reason(s, 9 * 60, True, 10.0) == "the machine is in use"
    assert pause_reason(s, 9 * 60, None, None) == ""
    assert pause_reason(ScheduleSettings(), 3 * 60, False, 0.0) == ""  # nothing asked for


def test_power_supply_is_read_from_sysfs(tmp_path):
    def dev(name, kind, **files):
        d = tmp_path / name
        d.mkdir()
        (d / "type").write_text(kind + "\n")
        for k, v in files.items():
            (d / k).write_text(v + "\n")
    assert on_mains_power(tmp_path) is None  # a desktop: nothing to say
    dev("BAT0", "Battery", status="Discharging")
    assert on_mains_power(tmp_path) is False
    dev("AC", "Mains", online="1")
    assert on_mains_power(tmp_path) is True


def test_the_ledger_survives_restarts_and_keeps_a_corrupt_file_aside(tmp_path):
    path = tmp_path / "run" / "credit.json"
    led = CreditLedger(path)
    led.record_trained(1000)
    led.record_sync(800, acknowledged=True)
    led.record_sync(200, acknowledged=False)
    led.record_round()
    again = CreditLedger(path).credit
    assert (again.tokens_trained, again.tokens_contributed, again.fragments_contributed, again.fragments_alone,
            again.rounds_joined) == (1000, 800, 1, 1, 1)
    path.write_text('{"tokens_trained": -5}')
    assert CreditLedger(path).credit.tokens_trained == 0
    assert json.loads((tmp_path / "run" / "credit.json.corrupt").read_text()) == {"tokens_trained": -5}


def test_the_rate_limiter_holds_the_mean_rate():
    now = [0.0]
    lim = RateLimiter(1000.0, burst_s=0.5, clock=lambda: now[0])
    assert lim.reserve(400) == 0.0  # within the burst
    waits = []
    for _ in range(10):
        waits.append(lim.reserve(1000))
        now[0] += waits[-1]
    # 10 kB at 1 kB/s: about 10 s in all, whatever the burst
    assert 9.0 <= now[0] <= 10.5
    lim.set_rate(0)
    assert lim.reserve(10**9) == 0.0 and not lim.limited
    with pytest.raises(ValueError):
        lim.set_rate(-1)
