#!/usr/bin/env python3
"""Unpacks a lavapipe that exposes VK_KHR_cooperative_matrix into target/coop-lavapipe.

Bookworm's Mesa (22.3) has no cooperative matrices, so on this machine kind the wgpu tensor-core
path (kernels/wgsl/matmul_fwd_coop.wgsl) could only be refused. Mesa 26 lavapipe emulates
VK_KHR_cooperative_matrix (8x8x8, f16 x f16 -> f32, subgroup size 8): slowly, with scalar code,
but exactly enough to prove the kernels. This script takes Mesa from trixie-backports and what it
needs from trixie (its own glibc, loader and LLVM included), checks every package's SHA-256
against the signed-by-Debian index it came from, and unpacks them into a private root. Nothing is
installed on the system and nothing outside target/ is written.

It leaves `target/coop-lavapipe/run`, which runs a program against that root:
    target/coop-lavapipe/run target/debug/deps/wgpu_coop-<hash>
(trixie's dynamic loader with `--library-path` the root's libraries, and VK_DRIVER_FILES the
root's lavapipe only). A second run with the same package versions does nothing.

Usage: python3 scripts/coop_lavapipe.py [--dest DIR]
"""

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

MIRROR = "http://deb.debian.org/debian"
# Searched in this order: a package in backports wins over trixie's.
SUITES = ["trixie-backports", "trixie"]
WANT = ["mesa-vulkan-drivers", "libvulkan1", "libc6"]
# Packages whose files no library needs at run time (maintainer-script tooling, base layout).
SKIP = {"debconf", "debconf-2.0", "dpkg", "perl-base", "base-files", "usr-is-merged",
        "libc-bin", "install-info", "sensible-utils"}
ARCH = "x86_64-linux-gnu"


def fail(msg):
    print(f"coop_lavapipe: {msg}", file=sys.stderr)
    sys.exit(1)


def fetch(url):
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.read()
    except OSError as e:
        fail(f"cannot fetch {url}: {e}")


def parse_index(text, suite):
    pkgs = {}
    provides = {}
    for stanza in text.split("\n\n"):
        fields = {}
        key = None
        for line in stanza.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line
            elif ":" in line:
                key, _, val = line.partition(":")
                fields[key] = val.strip()
        name = fields.get("Package")
        if not name or name in pkgs:
            continue
        fields["suite"] = suite
        pkgs[name] = fields
        for p in fields.get("Provides", "").split(","):
            p = p.strip().split(" ")[0]
            if p:
                provides.setdefault(p, name)
    return pkgs, provides


def load_indexes(cache):
    indexes = []
    for suite in SUITES:
        path = cache / f"{suite}.Packages"
        if not path.exists():
            url = f"{MIRROR}/dists/{suite}/main/binary-amd64/Packages.xz"
            print(f"coop_lavapipe: index {url}", flush=True)
            path.write_bytes(lzma.decompress(fetch(url)))
        indexes.append(parse_index(path.read_text(encoding="utf-8"), suite))
    return indexes


def lookup(indexes, name):
    for pkgs, provides in indexes:
        if name in pkgs:
            return pkgs[name]
    for pkgs, provides in indexes:
        if name in provides:
            return pkgs[provides[name]]
    return None


def resolve(indexes):
    chosen = {}
    todo = list(WANT)
    while todo:
        name = todo.pop()
        if name in SKIP or name in chosen:
            continue
        pkg = lookup(indexes, name)
        if pkg is None:
            fail(f"no package provides {name} in {', '.join(SUITES)}")
        if pkg["Package"] in chosen:
            continue
        chosen[pkg["Package"]] = pkg
        deps = ",".join(pkg.get(f, "") for f in ("Pre-Depends", "Depends"))
        for group in deps.split(","):
            alts = [a.strip().split(" ")[0].split(":")[0] for a in group.split("|")]
            alts = [a for a in alts if a]
            if not alts or any(a in SKIP or a in chosen for a in alts):
                continue
            pick = next((a for a in alts if lookup(indexes, a)), None)
            if pick is None:
                fail(f"{pkg['Package']} needs one of {alts}, none of which is in the indexes")
            todo.append(pick)
    return chosen


def unpack(chosen, cache, root):
    for name, pkg in sorted(chosen.items()):
        deb = cache / Path(pkg["Filename"]).name
        if not deb.exists():
            data = fetch(f"{MIRROR}/{pkg['Filename']}")
            if hashlib.sha256(data).hexdigest() != pkg["SHA256"]:
                fail(f"{deb.name}: SHA-256 differs from the {pkg['suite']} index")
            deb.write_bytes(data)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    # Absolute links (libLLVM's, the loader's) would point into the host's /usr: make them
    # point into the root.
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            if p.is_symlink() and os.readlink(p).startswith("/"):
                target = root / os.readlink(p).lstrip("/")
                p.unlink()
                p.symlink_to(os.path.relpath(target, p.parent))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=str(Path(__file__).resolve().parent.parent / "target" / "coop-lavapipe"))
    args = ap.parse_args()
    dest = Path(args.dest).resolve()
    cache = dest / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    indexes = load_indexes(cache)
    chosen = resolve(indexes)
    stamp = "\n".join(f"{n} {p['Version']}" for n, p in sorted(chosen.items())) + "\n"
    stamp_path = dest / "packages.txt"
    run = dest / "run"
    if stamp_path.exists() and stamp_path.read_text() == stamp and run.exists():
        print(f"coop_lavapipe: up to date ({len(chosen)} packages) in {dest}")
        return
    root = dest / "root"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir()
    print(f"coop_lavapipe: unpacking {len(chosen)} packages into {root}", flush=True)
    unpack(chosen, cache, root)
    libdir = root / "usr" / "lib" / ARCH
    lvp = libdir / "libvulkan_lvp.so"
    loader = libdir / "ld-linux-x86-64.so.2"
    for f in (lvp, loader, libdir / "libvulkan.so.1"):
        if not f.exists():
            fail(f"{f} is missing after unpacking")
    icd = json.loads((root / "usr/share/vulkan/icd.d/lvp_icd.json").read_text())
    icd["ICD"]["library_path"] = str(lvp)
    (dest / "lvp_icd.json").write_text(json.dumps(icd, indent=2) + "\n")
    run.write_text(
        "#!/bin/sh\n"
        "# Written by scripts/coop_lavapipe.py: runs a program against the private Mesa root.\n"
        f'VK_DRIVER_FILES="{dest / "lvp_icd.json"}" exec "{loader}" --library-path "{libdir}" "$@"\n'
    )
    run.chmod(0o755)
    stamp_path.write_text(stamp)
    mesa = chosen["mesa-vulkan-drivers"]["Version"]
    print(f"coop_lavapipe: Mesa {mesa} lavapipe ready; run programs with {run}")


if __name__ == "__main__":
    main()
