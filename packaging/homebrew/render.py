"""Fill in packaging/homebrew/localllm.rb.in for a release's sdist.

    python packaging/homebrew/render.py dist/localllm-0.1.0.tar.gz --url URL [--homepage URL] [-o localllm.rb]

The version comes from the sdist's PKG-INFO (what pip and Homebrew will see), the sha256 from its
bytes; --url is where the sdist is published. Prints the formula, or writes it with -o.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import sys
import tarfile
from pathlib import Path

TEMPLATE = Path(__file__).resolve().with_name("localllm.rb.in")


def sdist_version(sdist: Path) -> str:
    """The Version field of the sdist's top-level PKG-INFO."""
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            info = next((m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")), None)
            f = tar.extractfile(info) if info is not None else None
            text = f.read().decode("utf-8") if f is not None else None
    except (tarfile.TarError, EOFError) as e:
        raise ValueError(f"{sdist.name} is not a gzipped tar file (an sdist): {e.__class__.__name__}") from None
    if text is None:
        raise ValueError(f"{sdist.name} has no PKG-INFO: not an sdist")
    meta = email.parser.Parser().parsestr(text)
    if meta["Name"] != "localllm" or not meta["Version"]:
        raise ValueError(f"{sdist.name} is not a localllm sdist (Name: {meta['Name']})")
    return meta["Version"]


def render(sdist: Path, url: str, homepage: str) -> str:
    sha = hashlib.sha256(sdist.read_bytes()).hexdigest()
    version = sdist_version(sdist)
    if version not in url:
        raise ValueError(f"the URL does not name version {version}: {url}")
    text = TEMPLATE.read_text(encoding="utf-8")
    for key, value in {"@URL@": url, "@SHA256@": sha, "@HOMEPAGE@": homepage}.items():
        text = text.replace(key, value)
    return text


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sdist", type=Path)
    ap.add_argument("--url", required=True, help="where the sdist is published")
    ap.add_argument("--homepage", default="https://pypi.org/project/localllm/")
    ap.add_argument("-o", "--output", type=Path)
    a = ap.parse_args(argv)
    try:
        text = render(a.sdist, a.url, a.homepage)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.output:
        a.output.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
