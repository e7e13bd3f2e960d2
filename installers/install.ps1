<#
.SYNOPSIS
    swarmstream on Windows: sets up WSL2 and runs the Linux installer (install.sh) inside it.

.DESCRIPTION
    swarmstream's network engine (the libp2p daemon) talks to the client over Unix sockets, so
    on Windows the client runs inside WSL2, Microsoft's Linux subsystem. This script:
      1. checks that this Windows can run WSL2 (Windows 10 2004 / build 19041 or newer);
      2. installs WSL if it is missing (that step needs an Administrator PowerShell once, and a
         restart of Windows);
      3. installs the Linux distribution (Ubuntu by default) if it is missing, and makes sure it
         runs as WSL version 2;
      4. installs Python 3 with its venv module inside it if missing (as the distribution's
         root, no password needed);
      5. runs install.sh (beside this script) inside the distribution, passing your options on.
    Every step says what failed and what to do. Run it again after any fix: each step that is
    already done is skipped. NVIDIA GPUs work inside WSL2 with the ordinary Windows driver.

.EXAMPLE
    powershell -ExecutionPolicy Bypass -File installers\install.ps1

.EXAMPLE
    powershell -ExecutionPolicy Bypass -File installers\install.ps1 --service swarmstream:RUN_ID@/ip4/...

.EXAMPLE
    powershell -ExecutionPolicy Bypass -File installers\install.ps1 --uninstall
#>
param(
    # The WSL distribution to install into (one that `wsl --list --online` names).
    [string]$Distro = "Ubuntu"
)
# Everything else goes to install.sh unchanged: --service ADDRESS, --uninstall, --purge --yes ...
# (a plain script, not an advanced one, so that --options land in $args instead of failing)
$InstallArgs = @($args)

$ErrorActionPreference = "Stop"

function Say([string]$Message) { Write-Host "swarmstream-install: $Message" }
function Step([string]$Message) { Write-Host ""; Write-Host "==> $Message" -ForegroundColor Cyan }
function Fail([string]$Message) {
    Write-Host "swarmstream-install: error: $Message" -ForegroundColor Red
    exit 1
}

# wsl.exe writes UTF-16 with NUL bytes to a pipe; make its lines readable
function Invoke-WslText([string[]]$Arguments) {
    $out = & wsl.exe @Arguments 2>&1
    $code = $LASTEXITCODE
    $text = (($out | ForEach-Object { "$_" }) -join "`n") -replace "`0", ""
    return @{ Code = $code; Text = $text }
}

function Test-Administrator {
    $identity = [Security.Principal.WindowsIdentity]::GetCurrent()
    return (New-Object Security.Principal.WindowsPrincipal($identity)).IsInRole(
        [Security.Principal.WindowsBuiltInRole]::Administrator)
}

# --- 1. Windows ------------------------------------------------------------------------------
Step "Checking Windows"
$build = [System.Environment]::OSVersion.Version.Build
if ($build -lt 19041) {
    Fail "WSL2 needs Windows 10 version 2004 (build 19041) or newer, or Windows 11; this is build $build. Update Windows, then run this script again."
}
Say "Windows build $build"

$installSh = Join-Path $PSScriptRoot "install.sh"
if (-not (Test-Path $installSh)) {
    Fail "install.sh is not beside this script ($PSScriptRoot); download both files into one folder and run this again."
}

# --- 2. WSL itself -----------------------------------------------------------------------------
Step "Checking WSL"
if (-not (Get-Command wsl.exe -ErrorAction SilentlyContinue)) {
    $status = @{ Code = 1; Text = "wsl.exe not found" }
} else {
    $status = Invoke-WslText @("--status")
}
if ($status.Code -ne 0) {
    if (-not (Test-Administrator)) {
        Fail "WSL is not installed. Open PowerShell as Administrator (right-click, Run as administrator) and run this script again; it installs WSL, then asks you to restart Windows."
    }
    Say "installing WSL (this downloads it from Microsoft and can take a few minutes)"
    & wsl.exe --install --no-distribution
    if ($LASTEXITCODE -ne 0) {
        Fail "wsl --install failed (code $LASTEXITCODE). Turn on virtualization in your PC's firmware settings (BIOS/UEFI) if Windows says it is off, then run this again."
    }
    Say "WSL is installed. Restart Windows, then run this script again (as your normal user)."
    exit 0
}
Say "WSL is installed"
& wsl.exe --set-default-version 2 | Out-Null

# --- 3. The distribution, as WSL version 2 ---------------------------------------------------------
Step "Checking the $Distro distribution"
$list = Invoke-WslText @("--list", "--verbose")
$row = $list.Text -split "`n" | Where-Object { $_ -match "^\s*\*?\s*$([regex]::Escape($Distro))\s+" } | Select-Object -First 1
if (-not $row) {
    Say "installing $Distro into WSL"
    & wsl.exe --install --distribution $Distro
    if ($LASTEXITCODE -ne 0) {
        Fail "could not install $Distro (code $LASTEXITCODE); see the names WSL offers with: wsl --list --online, and pass one with -Distro NAME"
    }
    Say "$Distro is installed. If a window asked you for a Linux user name and password, finish that, then run this script again."
    exit 0
}
if ($row -match "\s1\s*$") {
    Say "$Distro runs as WSL version 1; converting it to version 2 (this can take a few minutes)"
    & wsl.exe --set-version $Distro 2
    if ($LASTEXITCODE -ne 0) {
        Fail "could not convert $Distro to WSL2 (code $LASTEXITCODE); turn on 'Virtual Machine Platform' in Windows Features, restart, and run this again."
    }
}
Say "$Distro runs as WSL2"

# --- 4. Python inside --------------------------------------------------------------------------
Step "Checking Python inside $Distro"
$check = 'import sys, venv, ensurepip; sys.exit(0 if sys.version_info >= (3, 10) else 1)'
& wsl.exe --distribution $Distro -- python3 -c $check 2>$null
if ($LASTEXITCODE -ne 0) {
    Say "installing Python 3 and its venv module inside $Distro (as its root user)"
    & wsl.exe --distribution $Distro --user root -- sh -c "apt-get update -q && apt-get install -y -q python3 python3-venv"
    & wsl.exe --distribution $Distro -- python3 -c $check 2>$null
    if ($LASTEXITCODE -ne 0) {
        Fail "$Distro has no Python 3.10+ with venv. Open it (wsl -d $Distro) and install one (for Ubuntu: sudo apt install python3 python3-venv), then run this again."
    }
}
Say "Python is ready"

# --- 5. The Linux installer ----------------------------------------------------------------------
if ($InstallArgs -contains "--uninstall") { Step "Running the uninstaller inside $Distro" } else { Step "Running the installer inside $Distro" }
$linuxPath = (Invoke-WslText @("--distribution", $Distro, "--", "wslpath", "-a", $installSh)).Text.Trim()
if (-not $linuxPath) {
    Fail "could not translate $installSh into a path inside $Distro"
}
& wsl.exe --distribution $Distro -- bash $linuxPath @InstallArgs
if ($LASTEXITCODE -ne 0) {
    Fail "the installer inside $Distro failed (code $LASTEXITCODE); its message is above"
}

if (-not ($InstallArgs -contains "--uninstall")) {
    Write-Host ""
    Say "from Windows, start swarmstream with:"
    Write-Host "    wsl -d $Distro -- bash -lc swarmstream"
    Say "a background service (--service) needs systemd in WSL: [boot] systemd=true in /etc/wsl.conf (the default for new Ubuntu installs)"
}
