"""``swarmstream doctor`` on this machine: real probes (torch, the bundled p2pd, a daemon started
for the reachability check), with the volunteer's files under a temporary SWARMSTREAM_HOME; and
the torch lines of machines this is not (a CUDA build without a GPU, a GPU, Apple's), from
what a probe would find."""

import json

from tui import doctor
from tui.cli import main
from tui.doctor import classify, torch_checks


def run_doctor(capsys, *flags):
    code = main(["doctor", "--json", *flags])
    return code, {c["name"]: c for c in json.loads(capsys.readouterr().out)}


def test_a_healthy_machine_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SWARMSTREAM_HOME", str(tmp_path))
    code, checks = run_doctor(capsys)
    assert code == 0
    assert checks["python"]["level"] == checks["torch"]["level"] == checks["libp2p daemon"]["level"] == "ok"
    assert checks["reachability"]["level"] in ("ok", "warn")  # a daemon started; direct or behind NAT
    assert "will be created" in checks["identity"]["detail"]
    assert not (tmp_path / "data" / "identity.key").exists()  # the doctor creates nothing


def test_bad_files_fail_with_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SWARMSTREAM_HOME", str(tmp_path))
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "settings.toml").write_text('[compute]\ndevice = "gpu"\n')
    (tmp_path / "data").mkdir()
    key = tmp_path / "data" / "identity.key"
    key.write_bytes(b"x" * 68)
    key.chmod(0o644)
    code, checks = run_doctor(capsys, "--offline")
    assert code == 1
    assert checks["settings"]["level"] == "FAIL" and "compute.device" in checks["settings"]["detail"]
    assert checks["identity"]["level"] == "FAIL" and "chmod 600" in checks["identity"]["hint"]
    assert "reachability" not in checks
    assert (tmp_path / "config" / "settings.toml").read_text() == '[compute]\ndevice = "gpu"\n'  # untouched


def test_reachability_is_read_from_the_visible_addresses():
    assert classify(["/ip4/127.0.0.1/tcp/1", "/ip4/192.168.1.5/tcp/1"]) == ("behind NAT", "")
    assert classify(["/ip4/10.0.0.2/tcp/1", "/ip4/203.0.113.7/tcp/4001"])[0] == "behind NAT"  # TEST-NET
    assert classify(["/ip4/8.8.8.8/tcp/4001/p2p/x"]) == ("direct", "8.8.8.8")
    assert classify(["/ip6/2001:4860::1/tcp/1"]) == ("direct", "2001:4860::1")


CUDA_BUILD = {"version": "2.14.1+cu130", "cuda": "13.0", "devices": [], "cuda_bytes": 5_400_000_000}
CPU_BUILD = {"version": "2.13.0+cpu", "cuda": None, "devices": []}


def test_a_cuda_build_without_a_gpu_is_a_warning_with_the_size_and_the_way_back():
    """The PyPI build on a machine without NVIDIA's driver: gigabytes of CUDA libraries for
    nothing. The doctor says so (warn, not ok), with the size and how to get the CPU build."""
    checks = {c.name: c for c in torch_checks(CUDA_BUILD, nvidia_driver=False)}
    torch = checks["torch"]
    assert torch.level == "warn"
    assert "2.14.1+cu130 (CUDA 13.0 build)" in torch.detail and "5.4 GB" in torch.detail
    assert "--uninstall" in torch.hint and "--torch cpu" in torch.hint and "INSTALL.md" in torch.hint
    assert checks["accelerator"].level == "warn"


def test_torch_lines_for_the_other_machines():
    # the CPU build without a GPU: fine, training runs on the CPU
    torch, accel = torch_checks(CPU_BUILD, nvidia_driver=False)
    assert (torch.level, torch.detail) == ("ok", "2.13.0+cpu (CPU build)")
    assert accel.level == "warn" and "CPU" in accel.hint
    # a CPU build beside an NVIDIA driver: reinstall with CUDA
    _, accel = torch_checks(CPU_BUILD, nvidia_driver=True)
    assert "--torch cuda" in accel.hint
    # a CUDA build, a driver, but no GPU torch can use: most likely a driver too old for it
    torch, accel = torch_checks({**CUDA_BUILD, "cuda_bytes": 0}, nvidia_driver=True)
    assert torch.level == "ok" and accel.level == "warn" and "update the driver" in accel.hint
    # a CUDA build that sees its GPU
    gpu = {**CUDA_BUILD, "devices": ["cuda:0 NVIDIA H100 80 GiB"]}
    assert [(c.name, c.level) for c in torch_checks(gpu, nvidia_driver=True)] == [("torch", "ok"), ("accelerator", "ok")]
    assert [c.level for c in torch_checks({**CPU_BUILD, "devices": ["mps (Apple GPU)"]}, False)] == ["ok", "ok"]


def test_the_torch_probe_finds_a_cuda_build_and_its_libraries(tmp_path, monkeypatch):
    """check_torch end to end, with a stand-in for a CUDA build first on the probe's path:
    torch.version.cuda set, no GPU, and an nvidia-* distribution of 30 MB beside it."""
    torch = tmp_path / "torch"
    torch.mkdir()
    (torch / "__init__.py").write_text("__version__ = '2.14.1'\nfrom . import backends, cuda, version\n")
    (torch / "version.py").write_text("cuda = '13.0'\n")
    (torch / "cuda.py").write_text("def is_available():\n    return False\n")
    (torch / "backends.py").write_text("")
    lib = tmp_path / "nvidia" / "cublas" / "libcublas.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\0" * 30_000_000)
    info = tmp_path / "nvidia_stand_in_cublas-13.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia_stand_in_cublas\nVersion: 13.0\n")
    (info / "RECORD").write_text("nvidia/cublas/libcublas.so,,\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(doctor, "has_nvidia_driver", lambda: False)
    torch_check, accelerator = doctor.check_torch()
    assert torch_check.level == "warn" and torch_check.detail.startswith("2.14.1 (CUDA 13.0 build) on a machine without")
    # 30 MB of the stand-in, plus whatever real torch the environment has beside it
    size = torch_check.detail.split("GPU: ")[1].split(" of torch")[0]
    assert size.endswith(" GB") or int(size.removesuffix(" MB")) >= 30
    assert accelerator.level == "warn"
