#!/usr/bin/env bash
# swarmstream installer for Linux and macOS (and Linux inside WSL2 on Windows).
#
#   bash install.sh                          install, or upgrade in place
#   bash install.sh --service RUN_ADDRESS    ... and contribute in the background
#   bash install.sh --uninstall              remove what the installer created
#   bash install.sh --uninstall --purge      ... and your key, checkpoints and settings
#
# It never needs root. Everything goes into a private virtual environment under your data
# dir, plus one launcher on your PATH (and, with --service, one systemd user unit or
# launchd agent). A list of what it created is kept beside the environment, and
# --uninstall removes exactly that. Runs with the bash 3.2 that macOS ships.
set -euo pipefail

PROG="swarmstream-install"
MARKER=".swarmstream-install"        # in the prefix: proves a folder is ours before rm -rf
CREATED="installed-files.txt"        # in the prefix: what we created outside it
LAUNCHER_TAG="# swarmstream launcher, written by install.sh"
SERVICE_NAME="swarmstream.service"
AGENT_LABEL="org.swarmstream.node"
# Linux CPU-only torch builds (PyPI's Linux builds bundle CUDA: several GB). The override is
# for tests and for a mirror of this index.
CPU_INDEX="${SWARMSTREAM_INSTALL_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
# Seconds one look at a package index may take before we call it unreachable. pip itself would
# wait PIP_DEFAULT_TIMEOUT (15 s, often set higher) per try, 5 retries per page, and for an extra
# index it asks about every dependency too: a hundred slow failures before it gives up.
PROBE_TIMEOUT=8

usage() {
    cat <<'EOF'
Usage: install.sh [options]

Install or upgrade:
  --prefix DIR        where the private environment goes (default: DATA_DIR/install)
  --bin-dir DIR       where the `swarmstream` launcher goes (default: ~/.local/bin)
  --python PATH       the Python (3.10+) to build the environment with (default: the newest found)
  --torch KIND        auto | cuda | mps | cpu | keep (default auto: cuda when an NVIDIA driver
                      answers, mps on Apple silicon, cpu otherwise; keep: leave torch as is)
  --torch-spec SPEC   the torch requirement (default "torch>=2.3"), e.g. "torch==2.5.1"
  --torch-index URL   the only package index torch comes from (default: PyPI; for cpu on
                      Linux also the PyTorch CPU index, when it answers: a 200 MB download
                      instead of GBs); checked once before use, an error if it does not answer
  --wheels DIR        a folder of wheels to install from first (offline machines: with --offline)
  --offline           use only --wheels DIR, never a package index
  --from SRC          what to install: a source folder, a wheel, or a pip requirement
                      (default: the checkout this script is in, else "swarmstream")
  --service ADDRESS   also install a background service that runs
                      `swarmstream join ADDRESS --headless` (systemd user unit / launchd agent)
  --no-start          with --service: install the service but do not start it

Remove:
  --uninstall         stop the service and node, remove the environment, the launcher and
                      the service; keeps your identity key, checkpoints and settings
  --purge             with --uninstall: delete those too (asks first unless --yes)
  --yes               answer yes to questions (needed for --purge without a terminal)

  -h, --help          this help

Environment: SWARMSTREAM_HOME moves the data and config dirs (as for swarmstream itself);
SWARMSTREAM_TORCH sets the default of --torch; SWARMSTREAM_PYTHON the default of --python;
SWARMSTREAM_INSTALL_CPU_INDEX replaces the PyTorch CPU index (a mirror of it).
EOF
}

say() { printf '%s: %s\n' "$PROG" "$*"; }
warn() { printf '%s: warning: %s\n' "$PROG" "$*" >&2; }
die() { printf '%s: error: %s\n' "$PROG" "$*" >&2; exit 1; }
step() { printf '\n==> %s\n' "$*"; }

# --- options -------------------------------------------------------------------------------

PREFIX=""
BIN_DIR="${HOME}/.local/bin"
PYTHON="${SWARMSTREAM_PYTHON:-}"
TORCH="${SWARMSTREAM_TORCH:-auto}"
TORCH_SPEC="torch>=2.3"
TORCH_INDEX=""
WHEELS=""
OFFLINE=0
FROM=""
SERVICE_ADDRESS=""
START_SERVICE=1
UNINSTALL=0
PURGE=0
YES=0

need_value() { if [ "$#" -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value (see --help)"; fi; }

while [ "$#" -gt 0 ]; do
    case "$1" in
        --prefix) need_value "$@"; PREFIX="$2"; shift 2 ;;
        --bin-dir) need_value "$@"; BIN_DIR="$2"; shift 2 ;;
        --python) need_value "$@"; PYTHON="$2"; shift 2 ;;
        --torch) need_value "$@"; TORCH="$2"; shift 2 ;;
        --torch-spec) need_value "$@"; TORCH_SPEC="$2"; shift 2 ;;
        --torch-index) need_value "$@"; TORCH_INDEX="$2"; shift 2 ;;
        --wheels) need_value "$@"; WHEELS="$2"; shift 2 ;;
        --offline) OFFLINE=1; shift ;;
        --from) need_value "$@"; FROM="$2"; shift 2 ;;
        --service) need_value "$@"; SERVICE_ADDRESS="$2"; shift 2 ;;
        --no-start) START_SERVICE=0; shift ;;
        --uninstall) UNINSTALL=1; shift ;;
        --purge) PURGE=1; shift ;;
        --yes | -y) YES=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

case "$TORCH" in
    auto | cuda | mps | cpu | keep) ;;
    *) die "--torch must be auto, cuda, mps, cpu or keep, not '$TORCH'" ;;
esac
[ "$PURGE" = 0 ] || [ "$UNINSTALL" = 1 ] || die "--purge only goes with --uninstall"
[ "$OFFLINE" = 0 ] || [ -n "$WHEELS" ] || die "--offline needs --wheels DIR (the wheels to install from)"
if [ -n "$WHEELS" ]; then
    [ -d "$WHEELS" ] || die "--wheels $WHEELS is not a folder"
    WHEELS="$(cd "$WHEELS" && pwd)"
fi
[ -n "${HOME:-}" ] || die "HOME is not set"
# The address's shape is checked now, before minutes of installing: a 32-character run ID
# (a-z, 2-7), '@', a multiaddr. The whole check comes once swarmstream is installed.
if [ -n "$SERVICE_ADDRESS" ]; then
    run_id="${SERVICE_ADDRESS#[Ss][Ww][Aa][Rr][Mm][Ss][Tt][Rr][Ee][Aa][Mm]:}"
    run_id="${run_id#"${run_id%%[!/]*}"}"  # and the slashes after the scheme
    run_id="${run_id%%@*}"
    case "$SERVICE_ADDRESS" in
        *?@/?*) ;;
        *) die "--service: not a run address ($SERVICE_ADDRESS); copy the whole address from the run's creator: swarmstream:RUN_ID@MULTIADDR" ;;
    esac
    [[ "$run_id" =~ ^[A-Za-z2-7]{32}$ ]] \
        || die "--service: not a run address (a run ID is 32 characters, a-z and 2-7, got '$run_id'); copy the whole address from the run's creator"
    unset run_id
fi

# --- where things go (the same rules as peer/paths.py: platformdirs, or SWARMSTREAM_HOME) ----

OS="${SWARMSTREAM_INSTALL_OS:-$(uname -s)}"  # the override exists for tests of the macOS files
case "$OS" in
    Linux)
        DATA_DIR="${XDG_DATA_HOME:-$HOME/.local/share}/swarmstream"
        CONFIG_DIR="${XDG_CONFIG_HOME:-$HOME/.config}/swarmstream"
        CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/swarmstream"
        ;;
    Darwin)
        DATA_DIR="$HOME/Library/Application Support/swarmstream"
        CONFIG_DIR="$DATA_DIR"
        CACHE_DIR="$HOME/Library/Caches/swarmstream"
        ;;
    MINGW* | MSYS* | CYGWIN*)
        die "on Windows, run installers/install.ps1 in PowerShell: it sets up WSL2 and runs this installer there" ;;
    *) die "unsupported system '$OS': swarmstream installs on Linux, macOS, and Windows through WSL2" ;;
esac
if [ -n "${SWARMSTREAM_HOME:-}" ]; then
    DATA_DIR="$SWARMSTREAM_HOME/data"
    CONFIG_DIR="$SWARMSTREAM_HOME/config"
fi
PREFIX="${PREFIX:-$DATA_DIR/install}"
case "$PREFIX" in /*) ;; *) PREFIX="$(pwd)/$PREFIX" ;; esac
case "$BIN_DIR" in /*) ;; *) BIN_DIR="$(pwd)/$BIN_DIR" ;; esac
VENV="$PREFIX/venv"
LAUNCHER="$BIN_DIR/swarmstream"
UNIT_PATH="${XDG_CONFIG_HOME:-$HOME/.config}/systemd/user/$SERVICE_NAME"
AGENT_PATH="$HOME/Library/LaunchAgents/$AGENT_LABEL.plist"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# single quotes for a POSIX shell: it's -> 'it'\''s'
shquote() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }

# --- the record of what we created outside the prefix ---------------------------------------

record() {  # record KIND PATH: once per path
    local line="$1 $2"
    if [ ! -f "$PREFIX/$CREATED" ] || ! grep -qxF "$line" "$PREFIX/$CREATED"; then
        printf '%s\n' "$line" >>"$PREFIX/$CREATED"
    fi
}

recorded() {  # recorded KIND: the paths of that kind, one a line
    [ -f "$PREFIX/$CREATED" ] || return 0
    local kind path
    while IFS=' ' read -r kind path; do
        [ "$kind" = "$1" ] && printf '%s\n' "$path"
    done <"$PREFIX/$CREATED"
    return 0
}

mkdir_recorded() {  # create a folder and each missing parent, recording those we made
    local dir="$1" missing=""
    while [ ! -d "$dir" ]; do
        missing="$dir
$missing"
        dir="$(dirname "$dir")"
    done
    [ -n "$missing" ] || return 0
    local d
    while IFS= read -r d; do  # parents first
        [ -n "$d" ] || continue
        mkdir "$d" || die "cannot create $d"
    done <<EOF
$missing
EOF
    while IFS= read -r d; do  # then the record (it lives in the prefix, which may be one of them)
        [ -n "$d" ] || continue
        record dir "$d"
    done <<EOF
$missing
EOF
}

# --- uninstall -------------------------------------------------------------------------------

stop_services() {
    local unit agent
    unit="$(recorded systemd)"
    if [ -n "$unit" ] && command -v systemctl >/dev/null 2>&1 && systemctl --user show-environment >/dev/null 2>&1; then
        systemctl --user disable --now "$SERVICE_NAME" >/dev/null 2>&1 || warn "could not stop $SERVICE_NAME"
    fi
    agent="$(recorded launchd)"
    if [ -n "$agent" ] && command -v launchctl >/dev/null 2>&1; then
        launchctl bootout "gui/$(id -u)/$AGENT_LABEL" >/dev/null 2>&1 || true
    fi
}

uninstall() {
    if [ ! -f "$PREFIX/$MARKER" ]; then
        if [ -e "$PREFIX" ]; then
            die "$PREFIX was not made by this installer (no $MARKER in it); nothing removed"
        fi
        if [ "$PURGE" = 1 ]; then  # uninstalled before: only the data is left to delete
            say "no swarmstream installation at $PREFIX"
            purge
            return
        fi
        die "no swarmstream installation at $PREFIX; if you installed with --prefix, pass the same --prefix"
    fi
    step "Stopping swarmstream"
    stop_services
    if [ -x "$VENV/bin/swarmstream" ] && "$VENV/bin/swarmstream" status >/dev/null 2>&1; then
        say "a node is running: stopping it now (it leaves its round)"
        "$VENV/bin/swarmstream" stop --now --wait >/dev/null 2>&1 || warn "the node did not stop; stop it with: kill \$(pgrep -f peer.node)"
    fi

    step "Removing what the installer created"
    local path
    for kind in systemd launchd launcher; do
        while IFS= read -r path; do
            [ -n "$path" ] || continue
            if [ "$kind" = launcher ] && [ -f "$path" ] && ! grep -qF "$LAUNCHER_TAG" "$path"; then
                warn "$path is not our launcher any more; left alone"
                continue
            fi
            if [ -e "$path" ] || [ -L "$path" ]; then
                rm -f "$path" && say "removed $path"
            fi
        done <<EOF
$(recorded "$kind")
EOF
    done
    if [ -n "$(recorded systemd)" ] && command -v systemctl >/dev/null 2>&1; then
        systemctl --user daemon-reload >/dev/null 2>&1 || true
    fi
    # folders we created, deepest first, and only while empty (a folder that gained files of
    # yours since, such as ~/.local/bin, stays)
    local dirs
    dirs="$(recorded dir | awk '{ print length($0) " " $0 }' | sort -rn | cut -d' ' -f2-)"
    rm -rf "$PREFIX"
    say "removed $PREFIX"
    while IFS= read -r path; do
        [ -n "$path" ] || continue
        case "$path" in "$PREFIX" | "$PREFIX"/*) continue ;; esac
        rmdir "$path" 2>/dev/null && say "removed $path (empty)"
    done <<EOF
$dirs
EOF

    if [ "$PURGE" = 1 ]; then
        purge
    else
        local kept=""
        for d in "$DATA_DIR" "$CONFIG_DIR"; do
            [ -d "$d" ] && kept="$kept $d"
        done
        if [ -n "$kept" ]; then
            say "kept your identity key, checkpoints, credit ledger and settings in:$kept"
            say "to delete them too: bash install.sh --uninstall --purge (your identity and credit cannot be recovered)"
        fi
    fi
    say "swarmstream is uninstalled"
}

purge() {
    local targets=""
    for d in "$DATA_DIR" "$CONFIG_DIR" "$CACHE_DIR" "${XDG_RUNTIME_DIR:-/nonexistent}/swarmstream"; do
        [ -e "$d" ] && targets="$targets
$d"
    done
    [ -n "$targets" ] || { say "no data, settings or cache to purge"; return 0; }
    if [ "$YES" != 1 ]; then
        [ -t 0 ] || die "--purge deletes your identity key and checkpoints; add --yes to confirm without a terminal"
        printf 'Delete your identity key, checkpoints, credit ledger and settings in:%s\n[y/N] ' "$targets"
        local answer
        read -r answer
        case "$answer" in y | Y | yes | YES) ;; *) say "purge cancelled; your data is kept"; return 0 ;; esac
    fi
    local d
    while IFS= read -r d; do
        [ -n "$d" ] || continue
        rm -rf "$d" && say "deleted $d"
    done <<EOF
$targets
EOF
}

# --- install ---------------------------------------------------------------------------------

python_ok() {  # python_ok PY: 3.10+ with venv and ensurepip
    "$1" -c 'import sys, venv, ensurepip; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1
}

find_python() {
    if [ -n "$PYTHON" ]; then
        command -v "$PYTHON" >/dev/null 2>&1 || die "--python $PYTHON: not found"
        python_ok "$PYTHON" || die "--python $PYTHON: need Python 3.10 or newer with the venv module ($("$PYTHON" --version 2>&1 || true))"
        command -v "$PYTHON"
        return
    fi
    local c found_old=""
    for c in python3.13 python3.12 python3.11 python3.10 python3 python; do
        if command -v "$c" >/dev/null 2>&1; then
            if python_ok "$c"; then
                command -v "$c"
                return
            fi
            found_old="$found_old $("$c" --version 2>&1 | tr -d '\n')"
        fi
    done
    local hint
    if [ "$OS" = Darwin ]; then
        hint="install one from https://www.python.org/downloads/macos/ or with Homebrew: brew install python@3.12"
    elif command -v apt-get >/dev/null 2>&1; then
        hint="install one with: sudo apt install python3 python3-venv"
    elif command -v dnf >/dev/null 2>&1; then
        hint="install one with: sudo dnf install python3"
    else
        hint="install Python 3.10 or newer with your system's package manager"
    fi
    if [ -n "$found_old" ]; then
        die "no Python 3.10+ with the venv module found (found:$found_old); $hint; or pass --python PATH"
    fi
    die "no Python found; swarmstream needs Python 3.10 or newer: $hint"
}

has_nvidia() {
    local smi
    for smi in nvidia-smi /usr/lib/wsl/lib/nvidia-smi; do  # the second: NVIDIA's driver inside WSL2
        if command -v "$smi" >/dev/null 2>&1 && "$smi" -L >/dev/null 2>&1; then
            return 0
        fi
    done
    return 1
}

choose_torch() {
    if [ "$TORCH" != auto ]; then
        return
    fi
    if [ "$OS" = Darwin ]; then
        if [ "$(uname -m)" = arm64 ]; then TORCH=mps; else TORCH=cpu; fi
    elif has_nvidia; then
        TORCH=cuda
    else
        TORCH=cpu
    fi
}

pip_in_venv() {
    local args=(--disable-pip-version-check)
    [ -z "$WHEELS" ] || args+=(--find-links "$WHEELS")
    [ "$OFFLINE" = 0 ] || args+=(--no-index)
    "$VENV/bin/python" -m pip install "${args[@]}" "$@"
}

probe_index() {  # probe_index URL: status 0 if the index's torch page answers; else 1 and why, one line
    # One GET of URL/torch/ (PEP 503), no retries, the whole look (DNS included) bounded by
    # PROBE_TIMEOUT. Trusts what pip trusts: the system's CAs, pip's own bundle and PIP_CERT.
    "$VENV/bin/python" - "$1" "$PROBE_TIMEOUT" <<'EOF'
import os, ssl, sys, threading, urllib.error, urllib.parse, urllib.request

url, timeout = sys.argv[1].rstrip("/") + "/torch/", float(sys.argv[2])
why = ["no answer within %g s" % timeout]


def context():
    ctx = ssl.create_default_context()
    cafiles = [os.environ.get("PIP_CERT", "")]
    try:
        from pip._vendor import certifi
        cafiles.append(certifi.where())
    except ImportError:
        pass
    for cafile in cafiles:
        if cafile and os.path.isfile(cafile):
            ctx.load_verify_locations(cafile)
    return ctx


def look():
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == "file":
            path = urllib.request.url2pathname(parts.path)
            why[0] = "" if os.path.isdir(path) else "no folder " + path
            return
        request = urllib.request.Request(url, headers={"User-Agent": "swarmstream-install"})
        with urllib.request.urlopen(request, timeout=timeout, context=context()) as answer:
            why[0] = "" if answer.status == 200 else "HTTP %d from %s" % (answer.status, url)
    except urllib.error.HTTPError as e:
        why[0] = "HTTP %d from %s" % (e.code, url)
    except urllib.error.URLError as e:
        why[0] = str(e.reason)
    except Exception as e:  # a timeout, a reset connection, a bad URL: all mean "not usable"
        why[0] = str(e) or type(e).__name__


worker = threading.Thread(target=look, daemon=True)
worker.start()
worker.join(timeout)  # getaddrinfo ignores socket timeouts: the thread bounds it
reason = "no answer within %g s" % timeout if worker.is_alive() else " ".join(why[0].split())
if reason:
    print(reason)
sys.stdout.flush()
os._exit(1 if reason else 0)  # not waiting for a thread stuck in DNS
EOF
}

report_torch() {  # which torch the environment now has, its build and size; advice for a CUDA build without a GPU
    local line version cuda torch_size env_size pyver
    line="$("$VENV/bin/python" - 2>/dev/null <<'EOF'
import importlib.metadata as md, os, re, sys
import torch

def size(dist):
    total = 0
    for f in dist.files or ():
        try:
            total += os.path.getsize(dist.locate_file(f))
        except OSError:
            pass
    return total

def cuda_part(name):  # torch and the CUDA libraries that its Linux CUDA builds pull in
    return name == "torch" or name == "triton" or name.startswith(("nvidia-", "cuda-"))

torch_bytes = sum(size(d) for d in md.distributions()
                  if cuda_part(re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower()))  # PEP 503 names
env_bytes = 0
for top, _, names in os.walk(sys.prefix):
    for n in names:
        try:
            env_bytes += os.lstat(os.path.join(top, n)).st_size
        except OSError:
            pass
def text(n):
    return "%.1f GB" % (n / 1e9) if n >= 1e9 else "%d MB" % round(n / 1e6)

print("|".join([torch.__version__, torch.version.cuda or "", text(torch_bytes), text(env_bytes),
                "%d.%d" % sys.version_info[:2]]))
EOF
)" || { warn "torch is installed but does not import; swarmstream doctor says why once swarmstream is in"; return 0; }
    IFS='|' read -r version cuda torch_size env_size pyver <<EOF
$line
EOF
    if [ -z "$cuda" ]; then
        say "the environment has torch $version, the CPU build: $torch_size (the environment so far: $env_size)"
        return 0
    fi
    say "the environment has torch $version, a CUDA $cuda build: $torch_size with its CUDA libraries (the environment so far: $env_size)"
    if [ "$OS" = Linux ] && ! has_nvidia; then
        local cpu_spec="torch==${version%%+*}+cpu"
        warn "no NVIDIA driver answers here, so those CUDA libraries are of no use on this machine"
        say "to replace it with the CPU build (about 0.2 GB to download, under 1 GB installed):"
        printf '    bash install.sh --uninstall     # keeps your key, checkpoints and settings\n'
        printf '    bash install.sh --torch-spec %s --wheels DIR\n' "$(shquote "$cpu_spec")"
        printf '        # DIR: a folder with the Python %s wheel of it from %s/torch/\n' "$pyver" "$CPU_INDEX"
        printf '        # or, instead of --wheels DIR: --torch-index URL of a mirror of that index\n'
        say "see docs/INSTALL.md (machines without a GPU)"
    fi
}

default_source() {
    # a checkout: installers/ beside the project's pyproject.toml
    if [ -f "$SCRIPT_DIR/../pyproject.toml" ] && grep -q '^name = "swarmstream"' "$SCRIPT_DIR/../pyproject.toml"; then
        (cd "$SCRIPT_DIR/.." && pwd)
    else
        printf 'swarmstream\n'
    fi
}

write_launcher() {
    mkdir_recorded "$BIN_DIR"
    if [ -e "$LAUNCHER" ] && ! grep -qF "$LAUNCHER_TAG" "$LAUNCHER" 2>/dev/null; then
        die "$LAUNCHER exists and is not ours; move it away or choose another --bin-dir"
    fi
    local tmp="$LAUNCHER.tmp.$$"
    {
        printf '#!/bin/sh\n%s (prefix %s); install.sh --uninstall removes it\n' "$LAUNCHER_TAG" "$PREFIX"
        # shellcheck disable=SC2016  # "$@" is for the launcher, not for us
        printf 'exec %s "$@"\n' "$(shquote "$VENV/bin/swarmstream")"
    } >"$tmp"
    chmod 755 "$tmp"
    mv -f "$tmp" "$LAUNCHER"
    record launcher "$LAUNCHER"
}

check_address() {  # the run address, validated by swarmstream itself, and plain enough for unit files
    local why
    why="$("$VENV/bin/python" - "$1" <<'EOF'
import sys
from protocol.manifest import InvalidAddress, parse_run_address
try:
    address = parse_run_address(sys.argv[1])
except InvalidAddress as e:
    print(e)
else:
    print("" if address.bootstrap else "it names no peer to join through (RUN_ID@MULTIADDR)")
EOF
)" || die "could not check the run address with the installed swarmstream"
    [ -z "$why" ] || die "--service: not a run address ($why); copy the whole address from the run's creator"
    case "$1" in
        *[!A-Za-z0-9:@/.,_-]*) die "--service: the address has characters a service file cannot hold: $1" ;;
    esac
}

install_systemd_unit() {
    mkdir_recorded "$(dirname "$UNIT_PATH")"
    cat >"$UNIT_PATH" <<EOF
# swarmstream volunteer node, written by install.sh; install.sh --uninstall removes it.
[Unit]
Description=swarmstream volunteer node
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
ExecStart="$VENV/bin/swarmstream" join $1 --headless
# On SIGTERM the node finishes its step, contributes it and checkpoints (swarmstream stop
# does the same at the end of the round); a crash restarts it, a clean stop does not.
Restart=on-failure
RestartSec=30
TimeoutStopSec=120
# SIGTERM to the command alone, which passes it on to its node once: to every process of the
# unit, the node would take it twice (the second means "stop at once") and its libp2p daemon
# would die mid-step
KillMode=mixed
Environment=PYTHONUNBUFFERED=1
Nice=10

[Install]
WantedBy=default.target
EOF
    record systemd "$UNIT_PATH"
    say "wrote $UNIT_PATH"
    if [ "$START_SERVICE" = 0 ]; then
        say "start it with: systemctl --user enable --now $SERVICE_NAME"
    elif command -v systemctl >/dev/null 2>&1 && systemctl --user show-environment >/dev/null 2>&1; then
        systemctl --user daemon-reload
        systemctl --user enable --now "$SERVICE_NAME" >/dev/null 2>&1 \
            || die "systemd did not start $SERVICE_NAME; see: journalctl --user -u $SERVICE_NAME"
        say "started $SERVICE_NAME; it starts again when you log in"
        say "to keep it running while you are logged out: loginctl enable-linger $(id -un)"
    else
        warn "no systemd user session here (a container, or no login session); the unit is installed but not started"
        say "in a login session, start it with: systemctl --user enable --now $SERVICE_NAME"
    fi
}

xml_escape() { printf '%s' "$1" | sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g'; }

install_launchd_agent() {
    mkdir_recorded "$(dirname "$AGENT_PATH")"
    mkdir_recorded "$DATA_DIR/logs"
    local exe log
    exe="$(xml_escape "$VENV/bin/swarmstream")"
    log="$(xml_escape "$DATA_DIR/logs/service.log")"
    cat >"$AGENT_PATH" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">
<!-- swarmstream volunteer node, written by install.sh, removed by its uninstall option -->
<plist version="1.0">
<dict>
    <key>Label</key>
    <string>$AGENT_LABEL</string>
    <key>ProgramArguments</key>
    <array>
        <string>$exe</string>
        <string>join</string>
        <string>$1</string>
        <string>--headless</string>
    </array>
    <key>RunAtLoad</key>
    <true/>
    <!-- restart after a crash, not after a clean stop (swarmstream stop) -->
    <key>KeepAlive</key>
    <dict>
        <key>SuccessfulExit</key>
        <false/>
    </dict>
    <key>ThrottleInterval</key>
    <integer>30</integer>
    <key>ExitTimeOut</key>
    <integer>120</integer>
    <key>ProcessType</key>
    <string>Background</string>
    <key>Nice</key>
    <integer>10</integer>
    <key>EnvironmentVariables</key>
    <dict>
        <key>PYTHONUNBUFFERED</key>
        <string>1</string>
    </dict>
    <key>StandardOutPath</key>
    <string>$log</string>
    <key>StandardErrorPath</key>
    <string>$log</string>
</dict>
</plist>
EOF
    record launchd "$AGENT_PATH"
    say "wrote $AGENT_PATH (log: $DATA_DIR/logs/service.log)"
    if [ "$START_SERVICE" = 0 ]; then
        say "start it with: launchctl bootstrap gui/$(id -u) $(shquote "$AGENT_PATH")"
    elif command -v launchctl >/dev/null 2>&1; then
        launchctl bootout "gui/$(id -u)/$AGENT_LABEL" >/dev/null 2>&1 || true  # an older copy
        launchctl bootstrap "gui/$(id -u)" "$AGENT_PATH" \
            || die "launchd did not load the agent; try: launchctl bootstrap gui/$(id -u) $(shquote "$AGENT_PATH")"
        say "started $AGENT_LABEL; it starts again when you log in"
    else
        warn "no launchctl here; the agent is installed but not started"
    fi
}

install() {
    if [ "$(id -u)" = 0 ]; then
        warn "running as root installs swarmstream for root only; the installer never needs root"
    fi
    if [ -e "$PREFIX" ] && [ ! -f "$PREFIX/$MARKER" ] && [ -n "$(ls -A "$PREFIX" 2>/dev/null)" ]; then
        die "$PREFIX exists and was not made by this installer; choose another --prefix"
    fi

    step "Checking Python"
    local py
    py="$(find_python)"
    say "using $py ($("$py" --version 2>&1))"

    step "Creating the environment in $VENV"
    local upgrade=0
    if [ -f "$PREFIX/$MARKER" ] && [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c '' >/dev/null 2>&1; then
        upgrade=1
        say "an installation is already here: upgrading it in place"
    else
        mkdir_recorded "$PREFIX"
        [ -f "$PREFIX/$MARKER" ] || printf 'made by swarmstream install.sh; --uninstall removes this folder\n' >"$PREFIX/$MARKER"
        rm -rf "$VENV"  # a broken one (its Python was removed or upgraded): build it again
        "$py" -m venv "$VENV" || die "could not create a virtual environment with $py (on Debian/Ubuntu: sudo apt install python3-venv)"
        pip_in_venv --quiet --upgrade pip || warn "could not upgrade pip in the environment; going on with its own"
    fi

    step "Installing PyTorch"
    choose_torch
    if [ "$TORCH" = keep ]; then
        say "leaving torch as it is (--torch keep)"
    else
        # installed only when the environment has no torch that satisfies the spec: an upgrade
        # keeps the multi-GB torch you have. An index is looked at once, briefly, before pip
        # uses it: pip's retries against one that does not answer take minutes.
        local why
        if [ -n "$TORCH_INDEX" ]; then
            if [ "$OFFLINE" = 0 ]; then
                why="$(probe_index "$TORCH_INDEX")" \
                    || die "--torch-index $TORCH_INDEX cannot be used ($why); check the address and the network, or leave --torch-index out to use PyPI (see docs/INSTALL.md)"
            fi
            say "torch build: $TORCH, $TORCH_SPEC from ${WHEELS:+$WHEELS, then }$TORCH_INDEX"
            pip_in_venv --quiet --index-url "$TORCH_INDEX" "$TORCH_SPEC" \
                || die "could not install $TORCH_SPEC from $TORCH_INDEX (offline? get the wheel elsewhere, then --wheels DIR --offline)"
        elif [ "$TORCH" = cpu ] && [ "$OS" = Linux ] && [ -z "$WHEELS" ]; then
            if why="$(probe_index "$CPU_INDEX")"; then
                # beside the default index, not instead of it: torch's own dependencies come
                # from there, and pip prefers 2.x.y+cpu over 2.x.y of the same version
                say "torch build: cpu, $TORCH_SPEC, the CPU-only build from $CPU_INDEX"
                pip_in_venv --quiet --extra-index-url "$CPU_INDEX" "$TORCH_SPEC" \
                    || die "could not install $TORCH_SPEC (offline? get the wheel elsewhere, then --wheels DIR --offline)"
            else
                warn "the PyTorch CPU index $CPU_INDEX cannot be used ($why); installing $TORCH_SPEC from the default package index instead, on Linux usually a CUDA build of several GB"
                pip_in_venv --quiet "$TORCH_SPEC" \
                    || die "could not install $TORCH_SPEC (offline? get the wheel elsewhere, then --wheels DIR --offline)"
            fi
        else
            say "torch build: $TORCH, $TORCH_SPEC from ${WHEELS:+$WHEELS, then }the default package index"
            pip_in_venv --quiet "$TORCH_SPEC" \
                || die "could not install $TORCH_SPEC (offline? get the wheel elsewhere, then --wheels DIR --offline)"
        fi
        report_torch
    fi

    step "Installing swarmstream"
    local src="${FROM:-$(default_source)}"
    say "from $src"
    pip_in_venv --quiet --upgrade "$src" || die "could not install swarmstream from $src"
    local version
    version="$("$VENV/bin/swarmstream" --version)" || die "the installed swarmstream does not start; see the messages above"
    say "installed $version"

    step "Putting the launcher on your PATH"
    write_launcher
    say "$LAUNCHER -> $VENV/bin/swarmstream"

    if [ -n "$SERVICE_ADDRESS" ]; then
        step "Installing the background service"
        check_address "$SERVICE_ADDRESS"
        if [ "$OS" = Darwin ]; then
            install_launchd_agent "$SERVICE_ADDRESS"
        else
            install_systemd_unit "$SERVICE_ADDRESS"
        fi
    fi

    step "Done"
    if [ "$upgrade" = 1 ]; then say "upgraded $version in $PREFIX"; else say "installed $version in $PREFIX"; fi
    local run="swarmstream"
    case ":$PATH:" in
        *":$BIN_DIR:"*) ;;
        *)
            run="$LAUNCHER"
            say "$BIN_DIR is not on your PATH; add it with:"
            printf '    echo %s >> ~/.profile   # then open a new terminal\n' "$(shquote "export PATH=\"$BIN_DIR:\$PATH\"")"
            ;;
    esac
    cat <<EOF

Next:
    check this machine (accelerator, network, disk):   $run doctor
    watch a small local swarm train:                   $run demo
    open the dashboard, pick or paste a run:           $run
    join a run by its address:                         $run join ADDRESS

Remove it with: bash install.sh --uninstall
EOF
}

if [ "$UNINSTALL" = 1 ]; then
    uninstall
else
    install
fi
