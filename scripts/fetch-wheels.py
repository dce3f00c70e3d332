#!/usr/bin/env python3
"""Fetches the pinned files the build and the tests need into .cuda-headers/ (ignored by git):

- the CUDA and NVML headers of every version in cuda-versions.txt, into
  .cuda-headers/<version>/include;
- libclang for bindgen (the codegen crate), into .cuda-headers/libclang, with clang's builtin
  headers (stddef.h, stdint.h, ...) in .cuda-headers/libclang/clang/18: the libclang wheel ships
  the library alone, and clang cannot parse the C library's headers without its own, so they are
  taken from the clang-tidy wheel of the same LLVM release. .cargo/config.toml points
  LIBCLANG_PATH there, so the build never depends on a system libclang;
- the Vulkan loader and its headers, for the Vulkan layer's tests, into .cuda-headers/vulkan
  (include/, lib/libvulkan.so.1): Debian 12's libvulkan1 and libvulkan-dev packages (loader
  1.3.239) for the host's architecture, from the Debian archive in DEBIAN_MIRROR (default
  deb.debian.org), unpacked here with no package manager and no root. The test programs link
  against this copy and find it through their run path, whatever the system has.

Only Python's standard library is used (a fresh Debian or Ubuntu has python3 without pip). Every
file is pinned by name and SHA-256; wheels are fetched from the index in PIP_INDEX_URL (default
PyPI's simple index), so a mirror works too. Nothing is fetched when the files are already there.

Which wheels, and why the architecture of each:
- the CUDA header wheels are always the x86_64 ones: the headers are plain C text, the same bytes
  in the x86_64 and aarch64 wheels (the wheels are platform-tagged only for the libraries they
  also carry), so every host generates the same code from the same files;
- libclang runs on the build host, so its wheel is the host's (x86_64 or aarch64);
- clang's builtin headers cover every target clang supports, so the x86_64 clang-tidy wheel serves
  every host (there is no aarch64 one of this release).
"""

import hashlib
import html.parser
import io
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

X86_64 = "manylinux2014_x86_64.manylinux_2_17_x86_64"

VERSIONS_FILE = Path(__file__).resolve().parent.parent / "cuda-versions.txt"


def cuda_wheels():
    """CUDA version -> [(project, wheel file, sha256)], read from cuda-versions.txt (one list of
    versions for this script, codegen and CI): `version project==release#sha256=digest ...`."""
    wheels = {}
    for number, line in enumerate(VERSIONS_FILE.read_text().splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        pins = []
        for word in words[1:]:
            pin, _, digest = word.partition("#sha256=")
            project, _, release = pin.partition("==")
            if not project or not release or len(digest) != 64:
                fail(f"{VERSIONS_FILE.name}:{number}: {word!r} is not project==release#sha256=<64 hex digits>")
            file_name = f"{project.replace('-', '_')}-{release}-py3-none-{X86_64}.whl"
            pins.append((project, file_name, digest.lower()))
        if not pins:
            fail(f"{VERSIONS_FILE.name}:{number}: version {words[0]} names no wheels")
        wheels[words[0]] = pins
    return wheels


CUDA_HEADERS = {"cuda.h", "cudaTypedefs.h", "nvml.h", "cudaGL.h", "cudaEGL.h", "cudaVDPAU.h"}

# Host machine -> the libclang wheel (LLVM 18.1.1).
LIBCLANG_WHEELS = {
    "x86_64": ("libclang", "libclang-18.1.1-py2.py3-none-manylinux2010_x86_64.whl",
               "c533091d8a3bbf7460a00cb6c1a71da93bffe148f172c7d03b1c31fbf8aa2a0b"),
    "aarch64": ("libclang", "libclang-18.1.1-py2.py3-none-manylinux2014_aarch64.whl",
                "54dda940a4a0491a9d1532bf071ea3ef26e6dbaf03b5000ed94dd7174e8f9592"),
}
LIBCLANG_IN_WHEEL = "clang/native/libclang.so"
# clang's builtin headers of the same release, from the clang-tidy wheel.
BUILTIN_WHEEL = ("clang-tidy", f"clang_tidy-18.1.1-py2.py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
                 "b91805d3ceba678099644e0b66b0811fc42d713b23cb90de2a71540a059befe1")
BUILTIN_IN_WHEEL = "clang_tidy/data/lib/clang/18/include/"
RESOURCE_DIR = "clang/18"


# Host machine -> (Debian architecture, multiarch folder, SHA-256 of libvulkan1, of libvulkan-dev).
VULKAN_VERSION = "1.3.239.0-1"
VULKAN_LIBRARY = "libvulkan.so.1.3.239"
VULKAN_DEBS = {
    "x86_64": ("amd64", "x86_64-linux-gnu",
               "622f28b807ba55a1f5ad1622ff83aa2c5b11fedbec074850e04c10a8f28b43d3",
               "1a3dcf32a47524edfe5eef97bfdb0766fe656f4ae6c5e999291c6a7eb2f07655"),
    "aarch64": ("arm64", "aarch64-linux-gnu",
                "3a21d49fef3a9799a21ffd5faa5bd7a1bd35604417cd9f5cf74155afd3b5282e",
                "5b3ffb071485a1a732a5323673eb8e5694bb8f94d587f6292fb4c766a1ddba47"),
}
VULKAN_POOL = "pool/main/v/vulkan-loader"


def fail(message):
    sys.exit(f"fetch-headers: {message}")


class Links(html.parser.HTMLParser):
    """The file name -> address pairs of a PEP 503 project page."""

    def __init__(self):
        super().__init__()
        self.links = {}
        self._href = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links[data.strip()] = self._href

    def handle_endtag(self, tag):
        if tag == "a":
            self._href = None


def download(project, file_name, sha256, folder):
    """Downloads one pinned wheel into folder and checks its digest."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/") + "/"
    page_url = urllib.parse.urljoin(index, f"{project}/")
    try:
        with urllib.request.urlopen(page_url, timeout=120) as page:
            parser = Links()
            parser.feed(page.read().decode("utf-8", "replace"))
    except OSError as error:
        fail(f"cannot read {page_url}: {error}")
    href = parser.links.get(file_name)
    if href is None:
        fail(f"{file_name} is not listed at {page_url}")
    return fetch_url(urllib.parse.urljoin(page_url, href), folder / file_name, sha256)


def fetch_url(url, target, sha256):
    """Downloads one pinned file and checks its digest."""
    try:
        with urllib.request.urlopen(url, timeout=600) as response, open(target, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
    except OSError as error:
        fail(f"cannot download {url}: {error}")
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != sha256:
        fail(f"{target.name}: SHA-256 {digest}, expected the pinned {sha256}")
    return target


def deb_data(deb):
    """The data archive of a Debian package (an `ar` archive holding data.tar.*), opened."""
    blob = deb.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        fail(f"{deb.name} is not a Debian package")
    offset = 8
    while offset + 60 <= len(blob):
        name = blob[offset:offset + 16].decode("ascii", "replace").strip().rstrip("/")
        size = int(blob[offset + 48:offset + 58].decode("ascii").strip())
        start = offset + 60
        if name.startswith("data.tar"):
            return tarfile.open(fileobj=io.BytesIO(blob[start:start + size]))
        offset = start + size + (size & 1)
    fail(f"{deb.name} has no data archive")


def fetch_vulkan(dest, scratch, machine=None):
    """The host's loader into .cuda-headers/vulkan, or another machine's (`aarch64` for the
    emulated suite, scripts/cross-test.sh) into .cuda-headers/vulkan-<machine>."""
    folder = dest / ("vulkan" if machine is None else f"vulkan-{machine}")
    machine = machine or platform.machine()
    if machine not in VULKAN_DEBS:
        fail(f"no Vulkan loader package is pinned for {machine} (only {', '.join(VULKAN_DEBS)})")
    arch, multiarch, loader_sha, dev_sha = VULKAN_DEBS[machine]
    stamp = folder / "fetched-from"
    expected = f"vulkan-loader {VULKAN_VERSION} {arch}\n"
    if stamp.is_file() and stamp.read_text() == expected and (folder / "lib" / "libvulkan.so.1").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "lib").mkdir(parents=True)
    (folder / "include").mkdir()
    mirror = os.environ.get("DEBIAN_MIRROR", "https://deb.debian.org/debian").rstrip("/")
    for package, sha256 in (("libvulkan1", loader_sha), ("libvulkan-dev", dev_sha)):
        file_name = f"{package}_{VULKAN_VERSION}_{arch}.deb"
        deb = fetch_url(f"{mirror}/{VULKAN_POOL}/{file_name}", scratch / file_name, sha256)
        with deb_data(deb) as data:
            for member in data.getmembers():
                name = member.name.removeprefix("./")
                if not member.isfile():
                    continue
                if name == f"usr/lib/{multiarch}/{VULKAN_LIBRARY}":
                    target = folder / "lib" / "libvulkan.so.1"
                elif name.startswith("usr/include/"):
                    target = folder / "include" / name.removeprefix("usr/include/")
                else:
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data.extractfile(member).read())
    if not (folder / "lib" / "libvulkan.so.1").is_file() or not (folder / "include" / "vulkan" / "vulkan.h").is_file():
        fail(f"the vulkan-loader {VULKAN_VERSION} packages lack the loader or vulkan/vulkan.h")
    (folder / "lib" / "libvulkan.so").symlink_to("libvulkan.so.1")
    stamp.write_text(expected)
    print(f"fetch-headers: Vulkan loader {VULKAN_VERSION} ({arch}) in {folder}")


def fetch_cuda(dest, version, wheels, scratch):
    include = dest / version / "include"
    if all((include / name).is_file() for name in CUDA_HEADERS):
        return
    include.mkdir(parents=True, exist_ok=True)
    for project, file_name, sha256 in wheels:
        with zipfile.ZipFile(download(project, file_name, sha256, scratch)) as archive:
            for name in archive.namelist():
                base = name.rsplit("/", 1)[-1]
                if base in CUDA_HEADERS and "/include/" in name:
                    (include / base).write_bytes(archive.read(name))
    missing = sorted(name for name in CUDA_HEADERS if not (include / name).is_file())
    if missing:
        fail(f"the wheels for CUDA {version} lack {missing}")
    print(f"fetch-headers: CUDA {version} headers in {include}")


def fetch_libclang(dest, scratch):
    machine = platform.machine()
    if machine not in LIBCLANG_WHEELS:
        fail(f"no libclang wheel is pinned for {machine} (only {', '.join(LIBCLANG_WHEELS)})")
    wheels = [LIBCLANG_WHEELS[machine], BUILTIN_WHEEL]
    folder = dest / "libclang"
    stamp = folder / "fetched-from"
    expected = "".join(f"{file_name}\n" for _, file_name, _ in wheels)
    if stamp.is_file() and stamp.read_text() == expected and (folder / "libclang.so").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)
    resource_include = folder / RESOURCE_DIR / "include"
    resource_include.mkdir(parents=True)
    library = download(*LIBCLANG_WHEELS[machine], scratch)
    with zipfile.ZipFile(library) as archive:
        names = [name for name in archive.namelist() if name.endswith("/" + LIBCLANG_IN_WHEEL)]
        if len(names) != 1:
            fail(f"{library.name} has no single {LIBCLANG_IN_WHEEL}")
        (folder / "libclang.so").write_bytes(archive.read(names[0]))
    builtin = download(*BUILTIN_WHEEL, scratch)
    with zipfile.ZipFile(builtin) as archive:
        for name in archive.namelist():
            if name.startswith(BUILTIN_IN_WHEEL) and not name.endswith("/"):
                path = resource_include / name[len(BUILTIN_IN_WHEEL):]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(archive.read(name))
    if not (resource_include / "stddef.h").is_file():
        fail(f"{builtin.name} has no clang builtin headers under {BUILTIN_IN_WHEEL}")
    stamp.write_text(expected)
    print(f"fetch-headers: libclang 18.1.1 ({machine}) in {folder}")


def main():
    dest = Path(__file__).resolve().parent.parent / ".cuda-headers"
    dest.mkdir(exist_ok=True)
    # `vulkan <machine>`: only that machine's Vulkan loader (scripts/cross-test.sh).
    if sys.argv[1:2] == ["vulkan"] and len(sys.argv) == 3:
        with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as scratch:
            fetch_vulkan(dest, Path(scratch), sys.argv[2])
        return
    if len(sys.argv) > 1:
        fail(f"usage: {sys.argv[0]} [vulkan x86_64|aarch64]")
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as scratch:
        for version, wheels in cuda_wheels().items():
            fetch_cuda(dest, version, wheels, Path(scratch))
        fetch_libclang(dest, Path(scratch))
        fetch_vulkan(dest, Path(scratch))


if __name__ == "__main__":
    main()
