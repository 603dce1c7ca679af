#!/usr/bin/env python3
"""Checks deploy/Dockerfile's runtime package list against the shipped binaries' libraries.

  deploy/check_runtime_deps.py DOCKERFILE BINARY...

For every BINARY (the programs the image ships: kvpool-server, kvpool, kvpool-engine,
kvpool-worker, built on this Debian 12 machine without CUDA as the image builds them):
  1. each library it links directly (ELF NEEDED, read with `readelf -d`) is resolved with `ldd`
     and mapped to the Debian package that owns it (`dpkg -S`); that package must be named in
     the runtime stage's `apt-get install` list, unless the debian:bookworm-slim base image
     already has it (libc6, libgcc-s1, libstdc++6);
  2. every library `ldd` lists (the whole closure) must come from a listed package, the base
     image, or a package the listed ones depend on (installed `Depends`, read with dpkg-query),
     so apt pulls it in;
  3. every listed package must be needed by some binary, or be one of EXTRA_OK (tools the image
     carries on purpose), so the list does not rot the other way.
Prints each problem and exits 1 if there is any; exits 0 and prints a summary otherwise.
Needs readelf (binutils), ldd and dpkg: no docker.
"""
import os
import re
import subprocess
import sys

# Packages the debian:bookworm-slim base image already has (Priority: required).
BASE = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g"}
# Packages the runtime stage installs on purpose although no binary links them.
EXTRA_OK = {
    "ucx-utils": "ucx_info, to see which UCX transports the container has",
}


def runtime_packages(dockerfile):
    """The package names of the `apt-get install` in the last stage of DOCKERFILE."""
    text = open(dockerfile, encoding="utf-8").read()
    last = text[text.rfind("\nFROM ") :]
    joined = last.replace("\\\n", " ")
    for line in joined.splitlines():
        if "apt-get install" in line:
            cmd = line.split("apt-get install", 1)[1].split("&&", 1)[0]
            return {w for w in cmd.split() if not w.startswith("-")}
    sys.exit(f"check_runtime_deps: no apt-get install in the last stage of {dockerfile}")


def variants(path):
    """PATH, its real path and their other merged-/usr spellings (dpkg knows one of them)."""
    out = []
    for p in (path, os.path.realpath(path)):
        out.append(p)
        if p.startswith("/usr/lib/"):
            out.append(p[len("/usr") :])
        elif p.startswith("/lib/"):
            out.append("/usr" + p)
    return out


def owners(paths):
    """{path: package} for every library path, from one `dpkg -S` call."""
    queries = sorted({v for p in paths for v in variants(p)})
    r = subprocess.run(["dpkg", "-S"] + queries, capture_output=True, text=True)
    known = {}
    for line in r.stdout.splitlines():
        pkgs, _, file = line.partition(": ")
        known[file.strip()] = pkgs.split(",")[0].split(":")[0].strip()
    return {p: next((known[v] for v in variants(p) if v in known), None) for p in paths}


def ldd(binary):
    """{soname: resolved path} of the whole closure (vdso left out)."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    libs = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line)
        if m:
            libs[m.group(1)] = m.group(2)
        else:
            m = re.match(r"\s*(/\S+) \(", line)
            if m:
                libs[os.path.basename(m.group(1))] = m.group(1)
    return libs


def needed(binary):
    out = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True, check=True)
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out.stdout)


def depends_closure(packages):
    """PACKAGES plus every installed package they depend on, recursively (first alternative)."""
    seen, todo = set(), list(packages)
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        r = subprocess.run(
            ["dpkg-query", "-W", "-f=${Depends},${Pre-Depends}", p], capture_output=True, text=True
        )
        for dep in r.stdout.split(","):
            name = dep.split("|")[0].strip().split(" ")[0].split(":")[0]
            if name:
                todo.append(name)
    return seen


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    dockerfile, binaries = argv[1], argv[2:]
    listed = runtime_packages(dockerfile)
    installed = depends_closure(listed) | BASE
    problems, used = [], set()
    closures = {b: ldd(b) for b in binaries}
    package = owners({p for libs in closures.values() for p in libs.values() if os.path.exists(p)})
    for b in binaries:
        name = os.path.basename(b)
        libs = closures[b]
        direct = set(needed(b))
        for soname, path in sorted(libs.items()):
            if path == "not" or not os.path.exists(path):
                problems.append(f"{name}: {soname} is not found by ldd")
                continue
            pkg = package[path]
            if pkg is None:
                problems.append(f"{name}: {soname} ({path}) belongs to no Debian package")
                continue
            used.add(pkg)
            if soname in direct and pkg not in listed and pkg not in BASE:
                problems.append(
                    f"{name} links {soname} directly: add {pkg} to the runtime apt-get install"
                )
            elif pkg not in installed:
                problems.append(
                    f"{name}: {soname} comes from {pkg}, which no listed package pulls in"
                )
    for p in sorted(listed - used - set(EXTRA_OK)):
        problems.append(f"runtime stage installs {p}, which no shipped binary links")
    for p in problems:
        print("check_runtime_deps:", p)
    if problems:
        return 1
    print(
        f"check_runtime_deps: {len(binaries)} binaries, {len(used)} packages in their ldd "
        f"closure, all covered by the {len(listed)} listed ({', '.join(sorted(listed))})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
