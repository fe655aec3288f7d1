"""An arm64 Debian bookworm root for the Pi check: built once with debootstrap, cached, run under qemu-user.

The recipe (issue 12): qemu-user-static and binfmt-support from Debian; the
host's own Debian mirror; the host's CA store, resolv.conf and pip
configuration copied in; /proc, /dev and /sys mounted, with an empty tmpfs over
ROOT/sys/devices/system/cpu (the host's x86 CPU topology there makes `import
torch` segfault); and always an explicit QEMU_CPU, since qemu's default `max`
CPU computed visibly wrong losses.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

QEMU = Path("/usr/bin/qemu-aarch64-static")
BINFMT = Path("/proc/sys/fs/binfmt_misc")
INCLUDE = "python3,python3-venv,python3-pip,ca-certificates,sudo"  # sudo: the guide's lines run as written
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# etc/hosts: sudo in the chroot resolves the host's name
COPIED_FROM_HOST = ["etc/ssl/certs/ca-certificates.crt", "etc/resolv.conf", "etc/hosts", "etc/pip.conf", "etc/xdg/pip"]


class SetupError(Exception):
    """Something the person running the check has to install or change; the message says what."""


def preflight() -> None:
    if os.geteuid() != 0:
        raise SetupError("pi-check needs root (debootstrap, chroot, mounts): run 'sudo make pi-check'")
    missing = [name for name, path in [("qemu-user-static", QEMU), ("debootstrap", Path("/usr/sbin/debootstrap")),
                                       ("binfmt-support", Path("/usr/sbin/update-binfmts"))] if not path.exists()]
    if missing:
        raise SetupError(f"missing {', '.join(missing)}: run 'sudo apt-get install -y qemu-user-static "
                         "binfmt-support debootstrap', then make pi-check again")
    if not (BINFMT / "register").exists():
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], check=False)
    if not (BINFMT / "qemu-aarch64").exists() or "enabled" not in (BINFMT / "qemu-aarch64").read_text():
        subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], check=False, capture_output=True)
    if not (BINFMT / "qemu-aarch64").exists():
        raise SetupError("the kernel does not run aarch64 binaries through qemu: mount binfmt_misc "
                         "('mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc') and run "
                         "'update-binfmts --enable qemu-aarch64'")


def host_mirror() -> str:
    """The host's own Debian mirror (deb822 .sources or one-line sources.list), else deb.debian.org."""
    apt = Path("/etc/apt")
    for path in sorted(apt.glob("sources.list.d/*.sources")):
        for stanza in path.read_text().split("\n\n"):
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
            suites = re.search(r"^Suites:\s*(.+)$", stanza, re.M)
            if uris and suites and "security" not in uris.group(1) and "bookworm" in suites.group(1).split():
                return uris.group(1)
    if (apt / "sources.list").exists():
        for line in (apt / "sources.list").read_text().splitlines():
            match = re.match(r"deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", line + " ")
            if match and "security" not in match.group(1):
                return match.group(1)
    return "http://deb.debian.org/debian"


def build_base(base: Path, echo=print, arch: str = "arm64", include: str = INCLUDE) -> None:
    """debootstrap a minimal bookworm root once; a finished one (marker file) is reused."""
    marker = base / ".edgefl-base-complete"
    if marker.exists() and f"--include={include} " in marker.read_text():
        echo(f"reusing the cached {arch} root {base}")
        return
    if marker.exists():
        echo(f"the cached {arch} root {base} was built with other packages: building it again")
        unmount_all(base)
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=True)
    partial = base.with_name(base.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    mirror = host_mirror()
    echo(f"building the {arch} root in {base} with debootstrap from {mirror} (about 4-10 minutes, once)")
    done = subprocess.run(["debootstrap", f"--arch={arch}", "--variant=minbase", f"--include={include}", "bookworm",
                           str(partial), mirror], capture_output=True, text=True)
    if done.returncode != 0:
        raise SetupError(f"debootstrap failed ({done.returncode}); its last lines:\n{done.stdout[-1500:]}"
                         f"{done.stderr[-1500:]}")
    partial.rename(base)
    marker.write_text(f"debootstrap --arch={arch} --variant=minbase --include={include} bookworm {mirror}\n")


def fresh_copy(base: Path, root: Path) -> None:
    """A new root from the cached base, with the host's CA store, resolver and pip configuration."""
    if root.exists():
        unmount_all(root)  # never delete through a bind mount of the host's /dev or /sys
        subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=True)
    subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(root)], check=True)
    for relative in COPIED_FROM_HOST:
        source, target = Path("/") / relative, root / relative
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        elif source.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            shutil.copy2(source, target)


def mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    points = [line.split()[1].replace("\\040", " ") for line in Path("/proc/self/mounts").read_text().splitlines()]
    return sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)


def unmount_all(root: Path) -> None:
    """Lazily unmount whatever an interrupted run left mounted under root, deepest first."""
    for point in mounts_under(root):
        subprocess.run(["umount", "-l", point], check=False)
    left = mounts_under(root)
    if left:
        raise SetupError(f"cannot unmount {', '.join(left)}: unmount them by hand, then run make pi-check again")


@contextmanager
def mounted(root: Path, apt_archives: Path | None = None) -> Iterator[None]:
    """/proc, /dev, /sys (an empty tmpfs over its CPU topology) and optionally a shared apt archive cache."""
    points = [(["-t", "proc", "proc"], root / "proc"), (["--bind", "/dev"], root / "dev"),
              (["--bind", "/sys"], root / "sys"), (["-t", "tmpfs", "tmpfs"], root / "sys/devices/system/cpu")]
    if apt_archives is not None:
        apt_archives.mkdir(parents=True, exist_ok=True)
        points.append((["--bind", str(apt_archives)], root / "var/cache/apt/archives"))
    done: list[Path] = []
    try:
        for args, target in points:
            subprocess.run(["mount", *args, str(target)], check=True)
            done.append(target)
        yield
    finally:
        for target in reversed(done):
            subprocess.run(["umount", "-l", str(target)], check=False)


def guest_env(cpu: str, **extra: str) -> dict[str, str]:
    """A clean environment for the guest; QEMU_CPU reaches every qemu started by the guest's exec too."""
    return {"PATH": GUEST_PATH, "HOME": "/root", "LANG": "C.UTF-8", "QEMU_CPU": cpu, **extra}


def guest(root: Path, cpu: str, argv: list[str], **popen) -> subprocess.Popen:
    """Start argv inside the root under `QEMU_CPU=cpu`; the Popen's pid is the emulated process itself."""
    env = guest_env(cpu, **popen.pop("extra_env", {}))
    return subprocess.Popen(["chroot", str(root), *argv], env=env, **popen)


def run_guest(root: Path, cpu: str, argv: list[str], timeout: float = 3600) -> subprocess.CompletedProcess:
    process = guest(root, cpu, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(argv, process.returncode, out, "")


def size_mb(path: Path, exclude: list[str]) -> float:
    """Bytes on disk under path, one file system, without the given relative paths (apt caches)."""
    args = ["du", "-sx", "-B1", *[f"--exclude={path / e}" for e in exclude], str(path)]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return round(int(out.split()[0]) / 2**20, 1)


if __name__ == "__main__":
    preflight()
    build_base(Path(sys.argv[1]))
